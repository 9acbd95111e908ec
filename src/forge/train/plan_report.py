"""`forge-train --plan ...`: what a run would do to the model, computed without allocating any real tensor.

The model is built on the meta device and the plan runs for rank 0 of a fake process group of
`parallel.world_size` ranks (torch's "fake" backend: collectives are no-ops), so an 8B model on 32 ranks is
planned on a laptop in seconds. The transforms it lists are the records `parallelize` returns, in its order.

Peak memory per rank (bytes), with P the parameters this rank holds (its shards and stages):

    params 4P (fp32 master weights) + AdamW 8P (exp_avg, exp_avg_sq)
    + FSDP gather buffers in the compute dtype: 2 unsharded blocks (the one computing, the one prefetched) and the
      root unit's parameters (embedding, final norm, head), which FSDP keeps gathered from the forward to the end
      of the backward; so does DDP (dp_replicate > 1, dp_shard 1: FSDP2 over a shard group of one still copies the
      parameters into its gather buffers). Without FSDP, under bf16: 2P, the bf16 weights the step computes with
      (forge.train.compute_weights' copy in one process; autocast's casts, which the backward keeps, under tp or pp)
    + grads 4P + activations when the gradients exist at the start of a backward (gradient accumulation, or a
      1F1B pipeline); else the larger of the two (zero_grad sets them to None: they grow as the backward frees
      the activations)
    activations: in-flight micro-batch tokens T = micro_batch_size x seq_len (x the rank's in-flight share of the
      pipeline chunks: all under GPipe, min(chunks, pp - r) on 1F1B's rank r, and torch's warm-up plus one of its
      stage-chunks under interleaved 1F1B), one pipeline chunk's tokens T_c (T without a pipeline), the head's
      in-flight tokens T_h (T_c under a 1F1B schedule: the last stage runs each chunk's backward right after its
      forward; else T)
        no checkpointing:    T x L_r x block + T_h x head + T_c x head_grads
        full checkpointing:  T x L_r x d / tp + max(T_h x head + T_c x head_grads, T_c x block + (T_h - T_c) x head)
      where block = (7 d + 2 kv + 4 f) / tp (+ 2 d under tp: the all-gathered inputs of the attention and the MLP
      that their matmuls keep) times bytes, and on the last stage head = (2 d / tp (+ d under tp)) x bytes (final
      norm input and output) + what the loss keeps for its backward (+ V / tp x bytes: a pipeline stage keeps its
      output, the logits), and head_grads what lives only around one chunk's loss. Without tp the loss is forge's
      row-wise cross-entropy (forge.train.losses): it keeps the logits' gradient, V x bytes, made in its forward
      beside the logits (head_grads V x bytes), and frees the logits. Under tp, torch's vocabulary-parallel loss
      keeps the fp32 log-softmax, 4 V / tp, and its backward adds the fp32 gradients of the log-softmax and the
      logits and the exponentials, head_grads 12 V / tp. L_r are the
      rank's blocks, d the model width, kv the key/value width, f the MLP hidden width (in an MoE block the
      hidden width each token passes through: expert size x (top_k + shared experts), averaged over the
      blocks); a model.head_dim that sets the query width q apart from d counts 4 d + 3 q in place of 7 d;
      bytes = 2 under bf16 autocast, 4 in fp32. Under bf16 autocast a norm runs in fp32 and keeps an fp32 copy of
      its input: + 2 x 2 d / tp bytes per block and 2 d / tp before the head. Per block, autograd keeps: the two
      norms' inputs and outputs (4 d), q, k, v and the attention output for SDPA (2 d + 2 kv), the re-laid-out
      attention output fed to wo (d), and the SwiGLU's w1, w3, silu outputs and their product (4 f). Selective
      checkpointing is estimated as none.
    With context parallelism (cp > 1) T is the rank's seq_len / cp tokens, each block also keeps the other cp ranks'
    keys and values (+ 2 kv (cp - 1) per token). Under a dense mask (context parallelism, or document masking or
    a sliding window with SDPA) the boolean micro_batch_size x seq_len / cp x seq_len mask lives through the forward
    and each block's SDPA keeps a copy in the compute dtype (only the recomputed block's under full checkpointing).
    With parallel.defer_grad_sync=true under FSDP (dp_shard x cp > 1) the gradients accumulate unsharded until the
    last micro-batch: grads 4P x dp_shard x cp (a rank's routed experts 4P x dp_shard / ep under expert
    parallelism: their FSDP group); in a pipeline torch's stage then also keeps the stage's parameters
    unsharded through the step, in place of the 2 gathered blocks.

Initialisation (the `initialisation:` line): rank 0's fp32 shards and buffers on the training device, filled one
parameter at a time from row blocks drawn on the host; beyond them the host holds the larger of one parameter's
scratch (two fp32 blocks and a block's boolean masks) and the three fp32 rotary tables computed at init.

`--plan --materialize` then allocates rank 0's shards on the CPU and fills them through the real runs' sharded
initialisation (forge.parallel.init: each rank draws only the row blocks of its shards, no collective), timing it:
a 70B model on 512 ranks fits in a few GiB of host memory.
"""

import contextlib
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from forge.config import validate
from forge.config.degrees import Degrees, resolve_degrees
from forge.models.spec import spec_of
from forge.parallel.applied import Applied
from forge.train.plan_flags import PLAN_OPTIONS

GIB = 2**30

MATERIALIZE = False
"""Set by `--materialize` (with `--plan`, through take_plan_flag): also allocate and initialise rank 0's shards."""


@dataclass
class MemoryEstimate:
    """Bytes per rank."""

    params: float
    grads: float
    optimizer: float
    gather_buffers: float
    activations: float
    activations_checkpointed: float
    grads_at_peak: bool = True
    """Gradients exist when the activations peak (at the start of a backward): from an earlier micro-batch or
    pipeline chunk. Without, the gradients (set to None each step) grow as the backward frees activations."""

    def peak(self, checkpointed: bool) -> float:
        acts = self.activations_checkpointed if checkpointed else self.activations
        live = self.grads + acts if self.grads_at_peak else max(self.grads, acts)
        return self.params + self.optimizer + self.gather_buffers + live


def pipeline_in_flight(pp: int, schedule: str, microbatches: int, pp_rank: int = 0, stages: int = 1) -> float:
    """Fraction of a micro-batch whose activations are alive at once on pipeline rank `pp_rank` (with `stages` per
    rank): all of it without a pipeline or under GPipe; torch's 1F1B runs pp - r forwards on rank r before its first
    backward, interleaved 1F1B interleaved_warmup's stage-chunks, and then one more (the steady state's forward comes
    before its backward)."""
    if pp == 1 or schedule == "gpipe":
        return 1.0
    if stages == 1:
        return min(microbatches, pp - pp_rank) / microbatches
    alive = interleaved_warmup(pp, microbatches, pp_rank, stages) + 1
    return min(stages * microbatches, alive) / (stages * microbatches)


def interleaved_warmup(pp: int, microbatches: int, pp_rank: int, stages: int) -> int:
    """The forwards torch's interleaved 1F1B runs on `pp_rank` before its first backward: (stages - 1) rounds of
    microbatches and two per hop from the last rank, at most every stage-chunk (ScheduleInterleaved1F1B)."""
    per_round = microbatches // max(1, microbatches // pp)
    return min((stages - 1) * per_round + 2 * (pp - 1 - pp_rank), stages * microbatches)


def head_in_flight(pp: int, schedule: str, microbatches: int) -> float | None:
    """Fraction of a micro-batch whose head activations are alive at once: one chunk under a 1F1B schedule (the last
    stage runs each chunk's backward right after its forward); None (as the blocks') otherwise."""
    return 1 / microbatches if pp > 1 and schedule != "gpipe" else None


def estimate_memory(
    args,
    degrees: Degrees,
    local_params: int,
    rank_blocks: int,
    has_head: bool,
    micro_batch_size: int,
    seq_len: int,
    in_flight: float,
    act_bytes: int,
    deferred_sync: bool = False,
    dense_masks: bool = False,
    grads_at_peak: bool = True,
    chunks: int = 1,
    root_params: float = 0.0,
    local_experts: int = 0,
    head_share: float | None = None,
) -> MemoryEstimate:
    """The peak memory of the module docstring's formula. `dense_masks`: attention runs SDPA under a boolean mask
    (document masking, or a sliding window, without flex), which SDPA keeps converted to the compute dtype per
    block; context parallelism always does. `grads_at_peak`: see MemoryEstimate (forge.train.plan_report's
    grads_at_peak tells it from the layout). `chunks`: the pipeline chunks of a micro-batch (a backward starts
    with one chunk's gradients of the logits). `root_params`: the parameters outside the blocks that this rank
    holds, per tp rank (embedding, final norm, head): FSDP's root unit, which stays gathered from the forward to the
    end of the backward. `local_experts`: the routed expert parameters among `local_params`; under deferred sync
    they accumulate unsharded over their own FSDP group, dp_shard / ep ranks, not dp_shard x cp. `head_share`:
    the fraction of a micro-batch whose head activations are alive (head_in_flight; None: `in_flight`)."""
    cp, tp = degrees.cp, degrees.tp
    tokens = micro_batch_size * seq_len * in_flight / cp
    head_tokens = tokens if head_share is None else micro_batch_size * seq_len * head_share / cp
    chunk_tokens = micro_batch_size * seq_len / cp / chunks
    gathered = 1 if tp > 1 else 0  # sequence parallel: each matmul keeps its all-gathered (whole) input
    # bytes per token: the final norm's input and output, and what the loss keeps for its backward (a pipeline
    # stage also keeps the logits, its output); a chunk's loss adds what lives only around it
    vocab = args.vocab_size / tp
    logits = vocab * act_bytes if degrees.pp > 1 else 0
    if tp > 1:  # torch's loss_parallel: the fp32 log-softmax; its backward's fp32 gradients and exponentials
        loss_kept, loss_around = 4 * vocab, 3 * 4 * vocab
    else:  # forge's row-wise cross-entropy: the logits' gradient, made in the forward beside the logits
        loss_kept, loss_around = vocab * act_bytes, vocab * act_bytes
    # under bf16 autocast a norm runs in fp32 and keeps an fp32 copy of its input: 2 per block, 1 before the head
    norm_upcast = args.dim / tp * (4 - act_bytes)
    head = ((2 * args.dim / tp + gathered * args.dim) * act_bytes + norm_upcast + loss_kept + logits) if has_head else 0
    head_grads = chunk_tokens * loss_around if has_head else 0
    # context parallel: SDPA keeps the whole sequence's keys and values (cp x the rank's own)
    cost = spec_of(args).cost
    block = (cost.block_activation_elems(args) + cost.saved_kv_width(args) * (cp - 1)) / tp + gathered * 2 * args.dim
    # a dense mask: the boolean (seq / cp x seq) mask per sample lives through the forward, and each block's SDPA
    # keeps a copy in the compute dtype (under full checkpointing only the recomputed block's)
    # one row per sample with documents or windows; without, the context-parallel mask is one row, broadcast
    rows = micro_batch_size * in_flight if dense_masks else 1
    sdpa = getattr(args, "attention", "sdpa") == "sdpa"  # flex's BlockMask is (seq / 128)^2 blocks: left out
    mask = rows * seq_len * seq_len / cp if sdpa and (dense_masks or cp > 1) else 0
    block_bytes = block * act_bytes + 2 * norm_upcast
    full = tokens * rank_blocks * block_bytes + head_tokens * head + head_grads
    full += mask * (1 + rank_blocks * act_bytes)
    # full checkpointing: each block's input, then the head's backward, or one chunk's recomputed block beside
    # the other chunks' logits
    later = max(head_tokens * head + head_grads, chunk_tokens * block_bytes + (head_tokens - chunk_tokens) * head)
    ckpt = tokens * rank_blocks * args.dim / tp * act_bytes + later + mask * (1 + act_bytes)
    shard = degrees.fsdp_shard
    fsdp = fsdp_gathers(degrees)
    if fsdp:
        gather = (2 * cost.block_gather_params(args, degrees) / tp + root_params) * act_bytes
    else:  # the step computes with a bf16 copy of the weights it holds (forge.train.compute_weights in one process;
        # autocast's casts, which the backward keeps, under tp or pp alone); in fp32 with the weights themselves
        gather = local_params * act_bytes if act_bytes < 4 else 0
    grads = 4 * local_params
    if deferred_sync and shard > 1:
        expert_shard = max(degrees.dp_shard // degrees.ep, 1) if degrees.ep > 1 else shard
        unsharded = (local_params - local_experts) * shard + local_experts * expert_shard
        grads = 4 * unsharded
        if degrees.pp > 1:
            gather = unsharded * act_bytes
    return MemoryEstimate(4 * local_params, grads, 8 * local_params, gather, full, ckpt, grads_at_peak)


def fsdp_gathers(degrees: Degrees) -> bool:
    """Whether FSDP gathers the parameters: over shards, and over replicas too (FSDP2 over (dp_replicate, 1) copies
    the parameters into its gather buffers all the same)."""
    return degrees.fsdp_shard > 1 or degrees.dp_replicate > 1


def grads_at_peak(
    micro_batches: int, pp: int, pp_schedule: str, chunks: int = 1, pp_rank: int = 0, stages: int = 1
) -> bool:
    """Whether gradients exist when the activations peak: an earlier micro-batch made them (gradient
    accumulation), or a pipeline chunk's backward did before a later chunk's forward. GPipe runs every forward
    first; torch's 1F1B runs pp - rank warm-up forwards on pipeline rank `pp_rank` (interleaved, with `stages` per
    rank: interleaved_warmup of its stages x chunks), so with chunks = pp the first rank too runs every forward
    before its first backward."""
    if micro_batches > 1:
        return True
    if pp == 1 or pp_schedule == "gpipe":
        return False
    forwards = stages * chunks
    warmup = pp - pp_rank if stages == 1 else interleaved_warmup(pp, chunks, pp_rank, stages)
    return forwards > warmup


def uses_dense_masks(cfg: DictConfig) -> bool:
    """SDPA runs under a boolean mask: documents or a sliding window without flex (forge.models.common.attention)."""
    window = cfg.model.get("sliding_window")
    windowed = any(w is not None for w in (list(window) if OmegaConf.is_list(window) else [window]))
    documents = bool(cfg.data.get("document_masking", False))
    return cfg.model.get("attention", "sdpa") == "sdpa" and (documents or windowed)


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """Rank 0 of a `world_size` process group whose collectives do nothing (no memory, no peers)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_report(cfg: DictConfig, materialize: bool = False) -> str:
    """The report printed by `forge-train --plan`; with `materialize`, rank 0's shards are also allocated on the CPU
    and initialised as a real run would, and a line says their bytes, the seconds and the host memory it took."""
    from forge.metrics.flops import count_flops_per_token
    from forge.models.common.moe import moe_layers
    from forge.parallel.mesh import build_mesh, mesh_shape
    from forge.parallel.pipeline import build_stage_module, first_and_last_group, stages_per_rank
    from forge.parallel.plan import count_local_parameters, parallelize
    from forge.train import build

    world_size = cfg.parallel.world_size or 1
    notes = _fit_global_batch(cfg, world_size)
    degrees = validate(cfg, world_size)
    train, parallel = cfg.train, cfg.parallel
    model = build.build_meta_model(cfg)
    args = model.args
    total = sum(p.numel() for p in model.parameters())
    allocated = "rank 0 materialized on the CPU" if materialize else "nothing allocated"
    lines = [f"plan for {world_size} ranks (as rank 0), model {total / 1e9:.3f}B parameters, {allocated}", *notes]
    applied: list[Applied] = []
    group = fake_process_group(world_size) if world_size > 1 else contextlib.nullcontext()
    with group:
        mesh = build_mesh(degrees, "cpu")
        lines.append(f"mesh: {mesh_shape(degrees) or 'none (one process)'}")
        if degrees.ep > 1:
            lines[-1] += f" (non-expert weights: dp_shard={degrees.dp_shard} = dp_shard_mod_ep x ep, flattened)"
        parts = [model]
        if degrees.pp > 1:
            n_stages = degrees.pp * stages_per_rank(parallel.pp_schedule)
            parts = [build_stage_module(model, s, n_stages) for s in range(0, n_stages, degrees.pp)]
            lines.append(
                f"pipeline split into {n_stages} stages; rank 0 holds stages {list(range(0, n_stages, degrees.pp))}"
            )
        for part in parts:
            compute = "bf16" if train.dtype in ("auto", "bf16") else "fp32"  # auto is bf16 on GPUs
            applied += parallelize(part, mesh, degrees, parallel, torch.device("cpu"), compute)
        if degrees.pp > 1 and args.tie_embeddings:
            first_and_last_group(mesh, mesh["pp"])  # the groups a real run creates, on every rank
            shard = count_local_parameters(parts[0].tok_embeddings)
            lines.append(
                f"tied embeddings: stages 0 and {n_stages - 1} each hold the {args.vocab_size} x {args.dim} matrix; "
                f"each step the two all-reduce its gradient ({shard:,} elements, {4 * shard / 2**20:.1f} MiB fp32 "
                "per rank)"
            )
        local = sum(count_local_parameters(p) for p in parts)
        local_experts = sum(count_local_parameters(layer.experts) for p in parts for _, layer in moe_layers(p))
        rank_blocks = sum(len(p.layers) for p in parts)
        has_head = any(p.output is not None for p in parts)
        # global sizes of the parameters outside the blocks (embedding, final norm, head), per tp rank
        outside = sum(
            sum(t.numel() for t in p.parameters()) - sum(t.numel() for t in p.layers.parameters()) for p in parts
        )
        root_params = outside / degrees.tp
        if materialize:
            materialized = materialize_rank0(cfg, parts, degrees)
    lines.append("transforms, in order:")
    lines += [f"  {i}. {step.detail}" for i, step in enumerate(applied, 1)] or ["  (none)"]
    lines.append(
        f"parameters: total {total:,} | rank 0 holds {local:,} "
        f"({local / total:.4f} of the model, 1/{total / local:.1f})"
    )
    if getattr(args, "moe", None) is not None:
        lines.append(_expert_line(args, degrees, model, local, local_experts))
    lines.append(init_line(parts, local, args))
    if materialize:
        lines.append(materialized)

    flops = count_flops_per_token(args, train.seq_len)
    lines.append(
        f"FLOPs per token (seq_len {train.seq_len}): forward {flops.forward / 1e9:.2f} GFLOP, "
        f"training {flops.training / 1e9:.2f} GFLOP (3x forward); per rank per step "
        f"{flops.training * train.global_batch_size * train.seq_len / world_size / 1e12:.2f} TFLOP"
    )

    dtype = "bf16" if train.dtype in ("auto", "bf16") else "fp32"
    chunks = (parallel.microbatches or degrees.pp) if degrees.pp > 1 else 1
    in_flight = pipeline_in_flight(degrees.pp, parallel.pp_schedule, chunks, 0, stages_per_rank(parallel.pp_schedule))
    mem = estimate_memory(
        args,
        degrees,
        local,
        rank_blocks,
        has_head,
        train.micro_batch_size,
        train.seq_len,
        in_flight,
        2 if dtype == "bf16" else 4,
        deferred_sync=parallel.get("defer_grad_sync") is True,
        dense_masks=uses_dense_masks(cfg),
        local_experts=local_experts,
        grads_at_peak=grads_at_peak(
            train.global_batch_size // (degrees.dp * train.micro_batch_size),
            degrees.pp,
            parallel.pp_schedule,
            chunks,
            0,
            stages_per_rank(parallel.pp_schedule),
        ),
        chunks=chunks,
        root_params=root_params,
        head_share=head_in_flight(degrees.pp, parallel.pp_schedule, chunks),
    )
    checkpointed = parallel.activation_checkpoint == "full"
    weights = "FSDP gather" if fsdp_gathers(degrees) else "bf16 weights" if dtype == "bf16" else "gather"
    lines.append(
        f"estimated peak memory per rank ({dtype} activations, micro_batch_size {train.micro_batch_size}): "
        f"params {mem.params / GIB:.2f} + grads {mem.grads / GIB:.2f} + AdamW {mem.optimizer / GIB:.2f} "
        f"+ {weights} {mem.gather_buffers / GIB:.2f} GiB; activations {mem.activations / GIB:.2f} GiB "
        f"(full checkpointing: {mem.activations_checkpointed / GIB:.2f}); "
        f"peak {mem.peak(False) / GIB:.2f} GiB without checkpointing, {mem.peak(True) / GIB:.2f} GiB with"
        + (" (this config checkpoints)" if checkpointed else "")
    )
    lines.append("formula: see forge.train.plan_report (params 4P + grads 4P + AdamW 8P + gather + activations)")
    return "\n".join(lines)


def _host_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process in KiB (None where /proc is missing)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(found.group(1)) if found else None


def _reset_host_peak() -> bool:
    """Make VmHWM start again from the current RSS (Linux: clear_refs 5); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def init_line(parts: list, local: int, args) -> str:
    """What initialisation costs rank 0: its fp32 shards (and buffers) on the training device, filled one parameter
    at a time from row blocks drawn on the host (forge.parallel.init). Beyond them the host holds the larger of one
    parameter's scratch (two fp32 blocks, and up to four boolean masks of a block for a truncated normal) and the rotary
    tables while they are computed (the angles, cos and sin: three fp32 tables)."""
    from forge.models.common.init_spec import scratch_elements

    scratch = 4 * max(scratch_elements(p.shape) for part in parts for p in part.parameters())
    tables = 4 * spec_of(args).cost.host_tables_elems(args)
    host = max(scratch + scratch // 2, tables)
    return (
        f"initialisation: rank 0 allocates its {4 * local / GIB:.2f} GiB of fp32 shards on the training device and "
        f"fills them from row blocks drawn on the host, one parameter at a time: host memory beyond the runtime "
        f"{host / 2**20:.2f} MiB (scratch {scratch / 2**20:.2f} MiB, rotary tables {tables / 2**20:.2f} MiB), "
        "plus the shards themselves when the device is the CPU"
    )


def materialize_rank0(cfg: DictConfig, parts: list, degrees: Degrees) -> str:
    """Allocate rank 0's parallelized `parts` on the CPU and initialise them through the real runs' code path
    (build.materialize_parallel, or materialize_stages under pp); the line reporting bytes, time and host memory."""
    from forge.parallel.pipeline import materialize_stages
    from forge.train import build

    device, seed = torch.device("cpu"), cfg.train.seed
    rss_before = _host_kib("VmRSS")
    exact_peak = _reset_host_peak()
    start = time.perf_counter()
    if degrees.pp > 1:
        materialize_stages(parts, build.build_meta_model(cfg), seed, device)
    else:
        build.materialize_parallel(cfg, parts[0], device, seed)
    seconds = time.perf_counter() - start
    rss_after, peak = _host_kib("VmRSS"), _host_kib("VmHWM")
    params = {id(p): getattr(p, "_local_tensor", p) for part in parts for p in part.parameters()}.values()
    nbytes = sum(t.numel() * t.element_size() for t in params)
    count = sum(t.numel() for t in params)
    dtypes = "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in params}))
    buffers = sum(b.numel() * b.element_size() for part in parts for b in part.buffers())
    line = f"materialized rank 0: {nbytes:,} bytes of {dtypes} parameters ({count:,} parameters) and {buffers:,} "
    line += f"bytes of buffers in {seconds:.1f} s"
    if rss_before is not None and rss_after is not None and peak is not None:
        bound = "" if exact_peak else "at most "  # without a reset the peak may predate the initialisation
        line += (
            f"; host RSS {rss_before / 2**20:.2f} -> {rss_after / 2**20:.2f} GiB, "
            f"peak +{bound}{(peak - rss_before) / 2**20:.2f} GiB"
        )
    return line


def _expert_line(args, degrees: Degrees, model, local: int, local_experts: int) -> str:
    """Where the routed experts live: the ep split and this rank's share of the expert weights."""
    from forge.models.common.moe import moe_layers

    experts = sum(layer.experts.w1.numel() * 3 for _, layer in moe_layers(model))  # global shapes, DTensor or not
    num = args.moe.num_experts
    where = (
        f"ep={degrees.ep} (borrowed from dp_shard={degrees.dp_shard}; each expert's weights FSDP-sharded over "
        f"dp_shard / ep = {degrees.dp_shard // degrees.ep} rank(s)), {num // degrees.ep} of {num} experts per rank"
        if degrees.ep > 1
        else f"no expert parallelism (parallel.ep=1): all {num} experts on every rank, sharded like dense weights"
    )
    return (
        f"experts: {where} | routed expert parameters: total {experts:,}, rank 0 holds {local_experts:,} "
        f"(1/{experts / max(local_experts, 1):.1f}); other parameters on rank 0: {local - local_experts:,}"
    )


def _fit_global_batch(cfg: DictConfig, world_size: int) -> list[str]:
    """Raise train.global_batch_size to a multiple of micro_batch_size (1 when unset) x dp ranks (the plan is about
    the layout; a small default batch would otherwise refuse a large world size)."""
    train = cfg.train
    step = (train.micro_batch_size or 1) * resolve_degrees(cfg.parallel, world_size).dp
    if train.global_batch_size % step == 0:
        return []
    fitted = math.ceil(train.global_batch_size / step) * step
    note = f"note: train.global_batch_size={train.global_batch_size} raised to {fitted} for this plan"
    train.global_batch_size = fitted
    return [note]


def take_plan_flag(argv: list[str]) -> bool:
    """Remove `--plan`, `--materialize`, `--search` and `--search-top K` from argv in place (Hydra must not see
    them); True when `--plan` was there. `--materialize` sets MATERIALIZE, which print_plan reads; `--search` (or
    a `search.` override) selects the `search` config group and `--search-top K` sets search.top, both appended
    after the other overrides (Hydra reads its flags first); without `--plan` each is refused."""
    global MATERIALIZE
    for flag in PLAN_OPTIONS:
        if flag in argv and "--plan" not in argv:
            print(f"forge-train: {flag} works only with --plan", file=sys.stderr)
            sys.exit(2)
    if "--materialize" in argv:
        MATERIALIZE = True
        argv[:] = [a for a in argv if a != "--materialize"]
    added = []
    while "--search-top" in argv:
        at = argv.index("--search-top")
        rows = argv[at + 1] if at + 1 < len(argv) else ""
        if not rows.isdigit() or int(rows) < 1:
            print("forge-train: --search-top takes a number of rows, e.g. --search-top 10", file=sys.stderr)
            sys.exit(2)
        del argv[at : at + 2]
        added = [f"search.top={rows}"]
    searching = "--plan" in argv and ("--search" in argv or added or any(a.startswith("search.") for a in argv))
    argv[:] = [a for a in argv if a != "--search"]
    if searching and not any(a.startswith(("search=", "+search=")) for a in argv):
        added.insert(0, "search=default")
    argv += added
    if "--plan" not in argv:
        return False
    argv[:] = [a for a in argv if a != "--plan"]
    return True


def print_plan(cfg: DictConfig) -> None:
    print(plan_report(cfg, materialize=MATERIALIZE), file=sys.stdout, flush=True)
