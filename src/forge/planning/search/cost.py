"""The cost model of one layout: peak memory per rank and the time of one optimizer step, term by term.

Per optimizer step, on the busiest rank (the pipeline rank with the most work), with T = global batch x seq_len
tokens, dp = dp_replicate x dp_shard, n micro-batches of each dp rank's share, cp the context-parallel ranks that
split each sequence (T / dp / cp tokens per rank), and F the forward FLOPs per token of the rank's blocks (and
head, on the last stage) from forge.planning.flops:

    compute    = 3 F x T / dp / cp / tp / (peak x compute_efficiency)
    recompute  = F_blocks x T / dp / cp / tp / (peak x efficiency) under full checkpointing (one more forward); a tenth
                 of that under selective (the cheap ops recomputed)
    fsdp       = n x c x (s - 1) / s x P / tp x (gathers x param bytes + 4 reduce bytes) / link,
                 s = dp_shard x cp the FSDP shard group, c the pipeline chunks (microbatches; 1 without pp), each
                 reduce-scattered after its backward;
                 blocks gathered twice per chunk (forward, backward), the root (embedding, norm, head) once per
                 chunk; routed experts: their E / ep on this rank, over the dp_shard / ep ranks that share them
    replicate  = (n x c; without FSDP 1, or n in a pipeline) x 2 (r - 1) / r x 4 P_rank / link: the gradient
                 all-reduce over dp_replicate
    exposed dp = max(0, fsdp + replicate - compute - recompute) + one block's gather per micro-batch: FSDP prefetch
                 and the backward hide the rest; all of fsdp + replicate on a CPU host whose ranks share its
                 cores (Device.shares_cores: gloo moves and sums the bytes on the cores that compute)
    tp         = n x (blocks x (4, or 6 with full checkpointing) + 1 per end of the model on this stage)
                 all-reduces (as sequence-parallel all-gather + reduce-scatter) of micro x seq_len x dim
                 activations, 2 (tp - 1) / tp of them per rank, on the last stage the cross-entropy's three
                 all-reduces of one fp32 number per token (the logits stay split over the vocabulary) and in MoE
                 blocks the router logits' gradient: those bytes in n x c calls of each, a chunk's share of the
                 tokens each; plus the all-reduce of the replicated norm weights' gradients, whenever FSDP reduces
                 (n x c, or n where it defers; once per step without FSDP), not hidden
    cp         = n x blocks x (2, or 3 with full or selective checkpointing: selective recomputes the
                 collective too) passes over the keys and values (all-gathers forward and in the recompute,
                 reduce-scatters of their gradients backward) of micro x seq_len x
                 kv_width / tp elements (keys plus values per token: forge.models.llama.args), (cp - 1) / cp of them per
                 rank, in n x c x blocks x (4, or 6) calls, not hidden (attention waits on them)
    ep         = n x MoE blocks x (4, or 6) all-to-alls of micro x seq_len x top_k x dim, (ep - 1) / ep of them, in
                 n x c x MoE blocks x (4, or 6) calls
    pp p2p     = T / dp x dim activations sent per stage boundary and direction (forward from all but the last
                 stage, gradients back from all but the first); with tied embeddings the first and last stage
                 also all-reduce the embedding's gradient shard (4 V dim / tp / dp_shard bytes)
    bubble     = (compute + recompute) x (pp - 1) / microbatches (/ 2 for two stages per rank; / 3 more for the
                 zero-bubble schedules: forge.planning.memory.bubble_fraction);
                 none on a CPU host whose ranks share its cores (Device.shares_cores: the waiting rank's cores
                 serve the busy ones)
    latency    = every collective's launch (10 us inside a node, 30 us across; a calibrated profile's measured latency,
                 scaled by log2(group) / log2(the ranks it was measured over) for a smaller group: latency_share)

Links: a mesh dimension whose ranks span at most gpus_per_node consecutive ranks uses the intra-node bandwidth,
else the inter-node one (mesh order pp, dp_replicate, dp_shard, cp, tp: tp innermost; ep is the inner part of
dp_shard). Peak memory per rank is forge.planning.memory.estimate_memory's, the one `--plan` prints.
"""

import math
from dataclasses import dataclass

from forge.config.degrees import Degrees, defers_grad_sync
from forge.models.spec import spec_of
from forge.parallel.pipeline import V_SHAPED, rank_stages, stage_layers, stages_per_rank
from forge.planning.flops import count_flops_per_token
from forge.planning.memory import bubble_fraction, estimate_memory, grads_at_peak, head_in_flight, pipeline_in_flight
from forge.planning.search.devices import Device
from forge.planning.search.settings import SearchSettings

LATENCY_S = {"intra": 10e-6, "inter": 30e-6}
SELECTIVE_RECOMPUTE = 0.1
"""Share of a forward the selective mode recomputes (norms, activations, rope: memory-bound, no matmuls)."""
TERMS = ("compute", "recompute", "exposed_dp", "tp", "cp", "ep", "pp_p2p", "bubble", "latency")


@dataclass(frozen=True)
class Layout:
    """One point of the search: the parallel degrees, the pipeline schedule, checkpointing and micro-batch."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    activation_checkpoint: str
    micro_batch_size: int
    pp_schedule: str = "1f1b"
    microbatches: int = 1
    """Pipeline chunks of each micro-batch (1 without pp)."""
    cp: int = 1
    """Context-parallel ranks over which each sequence is split."""

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.dp_replicate, self.dp_shard, self.tp, self.pp, self.ep, self.cp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def overrides(self) -> list[str]:
        """Command-line overrides that select this layout."""
        out = [
            f"parallel.dp_replicate={self.dp_replicate}",
            f"parallel.dp_shard={self.dp_shard}",
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.ep={self.ep}",
            f"parallel.cp={self.cp}",
        ]
        if self.pp > 1:
            out += [f"parallel.pp_schedule={self.pp_schedule}", f"parallel.microbatches={self.microbatches}"]
        return [*out, f"parallel.activation_checkpoint={self.activation_checkpoint}",
                f"train.micro_batch_size={self.micro_batch_size}"]  # fmt: skip

    def short(self) -> str:
        parts = [f"{name}{size}" for name, size in zip(DEGREE_NAMES, self.degrees_tuple())]
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}/{self.microbatches}")
        return " ".join(parts) + f" ac={self.activation_checkpoint} mb={self.micro_batch_size}"

    def degrees_tuple(self) -> tuple[int, ...]:
        return self.dp_replicate, self.dp_shard, self.tp, self.pp, self.ep, self.cp


DEGREE_NAMES = ("rep", "shard", "tp", "pp", "ep", "cp")
"""How `Layout.short` names each of `degrees_tuple`."""


@dataclass
class Prediction:
    layout: Layout
    memory: float
    """Peak bytes per rank (the busiest pipeline rank)."""
    seconds: dict[str, float]
    """Each term of the step time (TERMS)."""
    tokens: int
    """Tokens per optimizer step."""
    flops: float
    """Model FLOPs per optimizer step (all ranks, no recompute)."""
    moved: dict[str, float]
    """Bytes this rank sends per step, by collective: fsdp_all_gather, fsdp_reduce_scatter, replicate_all_reduce,
    tp, ep, pp, tied_embedding (ring algorithms: (n - 1) / n of a gathered or reduced buffer)."""

    @property
    def step(self) -> float:
        return sum(self.seconds.values())

    @property
    def dominant(self) -> str:
        return max(self.seconds, key=self.seconds.get)


@dataclass
class ModelShape:
    """What the cost model reads of a model: its arguments and the parameters of each part."""

    args: object
    block_params: list[int]
    expert_params: list[int]
    """Of each block's parameters, its routed experts' (0 in a dense block)."""
    embedding: int
    head: int
    """Head and final norm (0 for a tied head, which is the embedding)."""

    @classmethod
    def of(cls, model) -> "ModelShape":
        """From a model on the meta device."""
        from forge.models.common.moe import moe_layers

        blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
        experts = [
            sum(p.numel() for _, layer in moe_layers(block) for p in layer.experts.parameters())
            for block in model.layers.values()
        ]
        # everything outside the blocks but the head and final norm: the token (and a position) embedding
        outside = ("layers.", "norm.", "output.")
        embedding = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(outside))
        head = sum(p.numel() for p in model.norm.parameters()) + (
            0 if model.args.tie_embeddings else model.output.weight.numel()
        )
        return cls(model.args, blocks, experts, embedding, head)


class Links:
    """Bandwidth and latency of each mesh dimension's collectives."""

    def __init__(self, layout: Layout, device: Device, settings: SearchSettings):
        intra = settings.intra_node_gbps * 1e9 if settings.intra_node_gbps else device.intra_node
        inter = settings.inter_node_gbps * 1e9 if settings.inter_node_gbps else device.inter_node
        per_node = settings.gpus_per_node
        tp, cp, shard, rep = layout.tp, layout.cp, layout.dp_shard, layout.dp_replicate
        spans = {"tp": tp, "cp": tp * cp, "ep": tp * cp * layout.ep, "dp_shard": tp * cp * shard,
                 "dp_replicate": tp * cp * shard * rep, "pp": tp * cp * layout.dp * layout.pp}  # fmt: skip
        self.kind = {dim: "intra" if span <= per_node else "inter" for dim, span in spans.items()}
        self.bandwidth = {dim: (intra if kind == "intra" else inter) * settings.comm_efficiency
                          for dim, kind in self.kind.items()}  # fmt: skip
        self.latency = {kind: device.latency_s or LATENCY_S[kind] for kind in LATENCY_S}
        groups = {"tp": tp, "cp": cp, "ep": layout.ep, "dp_shard": shard * cp, "dp_replicate": rep, "pp": 2}
        measured = device.latency_ranks if device.latency_s else None
        self.latency_share = {dim: latency_share(size, measured) for dim, size in groups.items()}

    def seconds(self, dim: str, nbytes: float, calls: float) -> tuple[float, float]:
        """(transfer seconds, launch latency seconds) of `calls` collectives moving `nbytes` per rank in all."""
        return nbytes / self.bandwidth[dim], calls * self.latency[self.kind[dim]] * self.latency_share[dim]


def latency_share(group: int, measured_over: int | None) -> float:
    """The share of a calibrated collective latency (measured over `measured_over` ranks) that one collective of
    `group` ranks pays: log2(group) / log2(measured_over), as the rounds of a tree or of recursive doubling, at
    most 1 (a larger group than the calibration's is charged the measured latency). Charging a tp2 collective the
    latency of all the calibrating ranks overprices tensor parallelism (benchmarks/search/predict_vs_measured.py
    compares both against measured step times)."""
    if not measured_over or measured_over < 2 or group < 2:
        return 1.0
    return min(1.0, math.log2(group) / math.log2(measured_over))


def predict(layout: Layout, shape: ModelShape, cfg_train, device: Device, settings: SearchSettings,
            dtype: str = "bf16", dense_masks: bool = False) -> Prediction:  # fmt: skip
    """Memory and step time of `layout` for a model of `shape` trained with `cfg_train` (seq_len, global batch);
    `dense_masks`: attention runs under dense masks (documents or windows with SDPA, as --plan counts them)."""
    args, degrees = shape.args, layout.degrees
    cost, moe = spec_of(args).cost, getattr(args, "moe", None)
    seq, batch = cfg_train.seq_len, cfg_train.global_batch_size
    act_bytes = 2 if dtype == "bf16" else 4
    peak = device.peak_flops(dtype) * settings.compute_efficiency
    links = Links(layout, device, settings)
    flops = count_flops_per_token(args, seq)
    per_block = (flops.forward - flops.head) / args.n_layers  # MoE blocks counted at their mean
    n_stages = layout.pp * stages_per_rank(layout.pp_schedule) if layout.pp > 1 else 1
    stages = stage_layers(args.n_layers, n_stages, layout.pp_schedule in V_SHAPED)
    tokens_rank = batch * seq / layout.dp / layout.cp
    n_micro = batch // layout.dp // layout.micro_batch_size
    chunks = layout.microbatches if layout.pp > 1 else 1  # FSDP reduces after each pipeline chunk's backward
    micro_tokens = layout.micro_batch_size * seq / layout.cp
    shard = layout.dp_shard * layout.cp  # FSDP's group: context-parallel ranks hold the same parameters
    # the search writes no parallel.defer_grad_sync: its default (DDP, and the zero-bubble schedules, which keep each
    # stage gathered through a schedule step and reduce it once at its end)
    deferred = defers_grad_sync(degrees, layout.pp_schedule)

    per_rank = stages_per_rank(layout.pp_schedule)
    head_alive = head_in_flight(layout.pp, layout.pp_schedule, layout.microbatches)
    worst: tuple[float, dict, float, dict] | None = None
    for pp_rank in range(layout.pp):
        mine = rank_stages(layout.pp_schedule, layout.pp, pp_rank) if layout.pp > 1 else [0]
        blocks = [int(b) for s in mine for b in stages[s]]
        first, last = 0 in mine, n_stages - 1 in mine
        params = sum(shape.block_params[b] for b in blocks)
        params += shape.embedding if first or (last and args.tie_embeddings) else 0
        params += shape.head if last else 0
        local = params / layout.tp / shard
        root = (params - sum(shape.block_params[b] for b in blocks)) / layout.tp  # FSDP's root unit, kept gathered
        in_flight = pipeline_in_flight(layout.pp, layout.pp_schedule, layout.microbatches, pp_rank, per_rank)
        mem = estimate_memory(args, degrees, local, len(blocks), last, layout.micro_batch_size, seq, in_flight,
                              act_bytes, deferred_sync=deferred, dense_masks=dense_masks,
                              grads_at_peak=grads_at_peak(n_micro, layout.pp, layout.pp_schedule, chunks, pp_rank,
                                                          per_rank),
                              chunks=chunks, root_params=root, head_share=head_alive)  # fmt: skip
        memory = mem.peak(layout.activation_checkpoint == "full")
        block_flops = per_block * len(blocks) * tokens_rank / layout.tp
        forward = block_flops + (flops.head * tokens_rank / layout.tp if last else 0)
        t = {term: 0.0 for term in TERMS}
        t["compute"] = 3 * forward / peak
        if layout.activation_checkpoint == "full":
            t["recompute"] = block_flops / peak
        elif layout.activation_checkpoint == "selective":
            t["recompute"] = SELECTIVE_RECOMPUTE * block_flops / peak
        busy = t["compute"] + t["recompute"]
        latency = 0.0
        hidden = 0.0
        moved: dict[str, float] = {}
        if shard > 1:
            experts = sum(shape.expert_params[b] for b in blocks)
            dense_blocks = sum(shape.block_params[b] for b in blocks) - experts
            root = params - dense_blocks - experts  # embedding, norm, head: not resharded after forward
            if deferred:  # the stage gathered once per schedule step, reduced once at its end
                gathers = _shard_traffic(layout, dense_blocks + root, experts)
                reduces, collectives = gathers, n_micro * 2 * len(blocks)
            else:
                # Blocks: forward, and again in backward, per pipeline chunk (each chunk's backward reduce-scatters
                # and reshards, forge.parallel.pipeline.ReducingStage); the root once, then again after each
                # chunk's backward but the last.
                gathers = _shard_traffic(layout, 2 * chunks * dense_blocks + chunks * root, 2 * chunks * experts)
                reduces = chunks * _shard_traffic(layout, dense_blocks + root, experts)
                collectives = n_micro * chunks * 3 * len(blocks)
            moved["fsdp_all_gather"] = n_micro * gathers * act_bytes
            moved["fsdp_reduce_scatter"] = n_micro * reduces * 4
            nbytes = moved["fsdp_all_gather"] + moved["fsdp_reduce_scatter"]
            seconds, lat = links.seconds("dp_shard", nbytes, collectives)
            hidden += seconds
            latency += lat
            if not device.shares_cores:  # there all of it is exposed, below
                t["exposed_dp"] += seconds / max(3 * len(blocks), 1)  # each micro-batch's first gather
        if layout.dp_replicate > 1:
            # FSDP reduces after each chunk; DDP once, but a pipeline's schedule reduces at the end of each of its
            # steps (one per micro-batch) whatever the sync setting says
            syncs = n_micro * chunks if shard > 1 else (n_micro if layout.pp > 1 else 1)
            moved["replicate_all_reduce"] = syncs * 2 * (layout.dp_replicate - 1) / layout.dp_replicate * 4 * local
            seconds, lat = links.seconds("dp_replicate", moved["replicate_all_reduce"], syncs * len(blocks))
            hidden += seconds
            latency += lat
        # the backward hides the data-parallel collectives, but not on a CPU whose ranks share its cores: there
        # gloo moves and sums the bytes on the cores that compute
        t["exposed_dp"] += hidden if device.shares_cores else max(0.0, hidden - busy)
        per_tp = 6 if layout.activation_checkpoint == "full" else 4
        if layout.tp > 1:
            t_share = (layout.tp - 1) / layout.tp
            reduces = len(blocks) * per_tp + first + last  # + the embedding's output, the head's input
            elems = reduces * 2 * t_share * micro_tokens * args.dim
            # vocabulary-parallel cross-entropy: the max, the sum of exponentials and the label's logit per token
            loss_bytes = 3 * 2 * t_share * micro_tokens * 4 if last else 0
            # the replicated norm weights' gradients (partial over the tp ranks), all-reduced when FSDP reduces:
            # after each pipeline chunk's backward, or each micro-batch's where FSDP defers to the end of a
            # schedule step; without FSDP once per step, at the clipping (in the gathered dtype under FSDP's mixed
            # precision, else fp32)
            norms = len(blocks) * cost.block_norm_elems(args) + (args.dim if last else 0)
            norm_bytes = 2 * t_share * norms * (act_bytes if shard > 1 else 4)
            norm_syncs = (n_micro if deferred else n_micro * chunks) if shard > 1 else 1
            # an MoE router's logits gradient (tokens x experts), summed over the tp ranks in each backward
            moe_blocks = sum(moe.in_block(b) for b in blocks) if moe is not None else 0
            router_bytes = moe_blocks * 2 * t_share * micro_tokens * moe.num_experts * act_bytes if moe_blocks else 0
            moved["tp"] = n_micro * (elems * act_bytes + loss_bytes + router_bytes) + norm_syncs * norm_bytes
            # each pipeline chunk's forward and backward run their own collectives (the bytes split among them)
            per_pass = reduces * 2 + (3 if last else 0) + moe_blocks
            calls = n_micro * chunks * per_pass + norm_syncs * (len(blocks) * 2 + (1 if last else 0))
            seconds, lat = links.seconds("tp", moved["tp"], calls)
            t["tp"] = seconds
            latency += lat
        if layout.cp > 1:
            per_cp = 4 if layout.activation_checkpoint == "none" else 6  # selective keeps matmuls, not collectives
            per_micro = len(blocks) * per_cp  # keys and values: a call each, per pass
            passes = n_micro * per_micro / 2  # the bytes: a micro-batch's keys and values, whatever its chunks
            calls = n_micro * chunks * per_micro  # each chunk makes its own calls
            elems = (
                passes * (layout.cp - 1) / layout.cp * layout.micro_batch_size * seq * cost.kv_width(args) / layout.tp
            )
            moved["cp"] = elems * act_bytes
            seconds, lat = links.seconds("cp", moved["cp"], calls)
            t["cp"] = seconds
            latency += lat
        if layout.ep > 1 and moe is not None:
            moe_blocks = sum(moe.in_block(b) for b in blocks)
            elems = n_micro * moe_blocks * per_tp * (layout.ep - 1) / layout.ep * micro_tokens * moe.top_k
            moved["ep"] = elems * args.dim * act_bytes
            seconds, lat = links.seconds("ep", moved["ep"], n_micro * chunks * moe_blocks * per_tp)
            t["ep"] = seconds
            latency += lat
        if layout.pp > 1:
            # activations forward to the next stage, their gradients back to the one before, where another rank
            # holds it (a V's two stages of one rank hand over in place)
            boundaries = sum((s + 1 < n_stages and s + 1 not in mine) + (s > 0 and s - 1 not in mine) for s in mine)
            # under tp a stage sends its sequence-sharded part of the activations: 1/tp of them
            moved["pp"] = boundaries * tokens_rank * args.dim * act_bytes / layout.tp
            seconds, lat = links.seconds("pp", moved["pp"], boundaries * n_micro * layout.microbatches)
            if args.tie_embeddings and (first or last):  # the embedding's gradient, summed with the other end
                moved["tied_embedding"] = 4 * shape.embedding / layout.tp / shard
                more, more_lat = links.seconds("pp", moved["tied_embedding"], 1)
                seconds, lat = seconds + more, lat + more_lat
            t["pp_p2p"] = seconds
            latency += lat
            if not device.shares_cores:  # else a waiting rank's cores serve the busy ones
                t["bubble"] = busy * bubble_fraction(layout.pp, layout.pp_schedule, layout.microbatches)
        t["latency"] = latency
        total = sum(t.values())
        if worst is None or total > worst[2]:
            worst = (max(memory, worst[0]) if worst else memory, t, total, moved)
        else:
            worst = (max(memory, worst[0]), *worst[1:])
    memory, seconds, _, moved = worst
    return Prediction(layout, memory, seconds, batch * seq, flops.training * batch * seq, moved)


def _shard_traffic(layout: Layout, dense: float, experts: float) -> float:
    """Elements a rank sends (ring) to gather or reduce-scatter `dense` elements over dp_shard x cp (per tp rank)
    and `experts` (routed-expert elements) over the (dp_shard / ep) x cp ranks that share them (this rank holds E / ep,
    and under tp its part of each one's hidden width)."""
    shard = layout.dp_shard * layout.cp
    if layout.ep == 1:  # the experts are sharded with the rest of their block
        return (shard - 1) / shard * (dense + experts) / layout.tp
    group = layout.degrees.expert_shard
    return (shard - 1) / shard * dense / layout.tp + (group - 1) / group * experts / layout.ep / layout.tp
