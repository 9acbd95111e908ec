"""`forge-train --plan ...`: what a run would do to the model, computed without allocating any real tensor.

The model is built on the meta device and the plan runs for rank 0 of a fake process group of
`parallel.world_size` ranks (torch's "fake" backend: collectives are no-ops), so an 8B model on 32 ranks is
planned on a laptop in seconds. The transforms it lists are the records `parallelize` returns, in its order.

Peak memory per rank: forge.planning.memory's formula (its module docstring).

Initialisation (the `initialisation:` line): rank 0's fp32 shards and buffers on the training device, filled one
parameter at a time from row blocks drawn on the host; beyond them the host holds the larger of one parameter's
scratch (two fp32 blocks and a block's boolean masks) and the three fp32 rotary tables computed at init.

`--plan --materialize` then allocates rank 0's shards on the CPU and fills them through the real runs' sharded
initialisation (forge.parallel.init: each rank draws only the row blocks of its shards, no collective), timing it:
a 70B model on 512 ranks fits in a few GiB of host memory.
"""

import contextlib
import logging
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from forge.config import validate
from forge.config.degrees import Degrees, defers_grad_sync, pipeline_chunks, resolve_degrees
from forge.models.spec import spec_of
from forge.parallel.applied import Applied
from forge.planning.flags import PLAN_OPTIONS
from forge.planning.memory import (
    MemoryEstimate,
    estimate_memory,
    fsdp_gathers,
    grads_at_peak,
    head_in_flight,
    pipeline_in_flight,
    uses_dense_masks,
)

GIB = 2**30

MATERIALIZE = False
"""Set by `--materialize` (with `--plan`, through take_plan_flag): also allocate and initialise rank 0's shards."""


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
    from forge.parallel.mesh import build_mesh, mesh_shape
    from forge.parallel.pipeline import (
        V_SHAPED,
        build_stage_module,
        first_and_last_group,
        rank_stages,
        stages_per_rank,
    )
    from forge.parallel.plan import count_local_parameters, parallelize
    from forge.planning.flops import count_flops_per_token
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
            if degrees.ep_spans_tp:
                lines[-1] += f"; the experts' group: (ep / tp) x tp = {degrees.ep} ranks"
        parts = [model]
        if degrees.pp > 1:
            n_stages = degrees.pp * stages_per_rank(parallel.pp_schedule)
            held = rank_stages(parallel.pp_schedule, degrees.pp, 0)
            parts = [build_stage_module(model, s, n_stages, parallel.pp_schedule in V_SHAPED) for s in held]
            lines.append(f"pipeline split into {n_stages} stages; rank 0 holds stages {held}")
        for part in parts:
            applied += parallelize(part, mesh, degrees, parallel, torch.device("cpu"), compute_dtype(cfg))
        if degrees.pp > 1 and args.tie_embeddings:
            first_and_last_group(mesh, mesh["pp"])  # the groups a real run creates, on every rank
            shard = count_local_parameters(parts[0].tok_embeddings)
            lines.append(
                f"tied embeddings: stages 0 and {n_stages - 1} each hold the {args.vocab_size} x {args.dim} matrix; "
                f"each step the two all-reduce its gradient ({shard:,} elements, {4 * shard / 2**20:.1f} MiB fp32 "
                "per rank)"
            )
        held0 = RankParts.of(parts)
        local, local_experts = held0.local, held0.local_experts
        mem = rank_memory(cfg, degrees, args, held0, 0)
        busiest = busiest_pipeline_rank(cfg, degrees, mesh, model, mem) if degrees.pp > 1 else None
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

    dtype = compute_dtype(cfg)
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
    if busiest is not None:
        lines.append(busiest)
    lines.append("formula: see forge.planning.memory (params 4P + grads 4P + AdamW 8P + gather + activations)")
    return "\n".join(lines)


def compute_dtype(cfg: DictConfig) -> str:
    return "bf16" if cfg.train.dtype in ("auto", "bf16") else "fp32"  # auto is bf16 on GPUs


@dataclass(frozen=True)
class RankParts:
    """What the memory estimate reads of the stage modules a pipeline rank holds, once parallelized."""

    local: int
    """Parameters this rank holds (its shards)."""
    local_experts: int
    """Of them, routed experts'."""
    blocks: int
    has_head: bool
    outside: int
    """Global sizes of the parameters outside the blocks (embedding, final norm, head)."""

    @classmethod
    def of(cls, parts: list) -> "RankParts":
        from forge.models.common.moe import moe_layers
        from forge.parallel.plan import count_local_parameters

        return cls(
            local=sum(count_local_parameters(p) for p in parts),
            local_experts=sum(count_local_parameters(layer.experts) for p in parts for _, layer in moe_layers(p)),
            blocks=sum(len(p.layers) for p in parts),
            has_head=any(p.output is not None for p in parts),
            outside=sum(
                sum(t.numel() for t in p.parameters()) - sum(t.numel() for t in p.layers.parameters()) for p in parts
            ),
        )


def rank_memory(cfg: DictConfig, degrees: Degrees, args, held: RankParts, pp_rank: int) -> MemoryEstimate:
    """The memory estimate of the pipeline rank `pp_rank` holding `held`."""
    from forge.parallel.pipeline import stages_per_rank

    train, parallel = cfg.train, cfg.parallel
    chunks = pipeline_chunks(degrees.pp, parallel.microbatches)
    stages = stages_per_rank(parallel.pp_schedule)
    return estimate_memory(
        args,
        degrees,
        held.local,
        held.blocks,
        held.has_head,
        train.micro_batch_size,
        train.seq_len,
        pipeline_in_flight(degrees.pp, parallel.pp_schedule, chunks, pp_rank, stages),
        2 if compute_dtype(cfg) == "bf16" else 4,
        deferred_sync=defers_grad_sync(degrees, parallel.pp_schedule, parallel.get("defer_grad_sync")),
        dense_masks=uses_dense_masks(cfg),
        local_experts=held.local_experts,
        grads_at_peak=grads_at_peak(
            train.global_batch_size // (degrees.dp * train.micro_batch_size),
            degrees.pp,
            parallel.pp_schedule,
            chunks,
            pp_rank,
            stages,
        ),
        chunks=chunks,
        root_params=held.outside / degrees.tp,
        head_share=head_in_flight(degrees.pp, parallel.pp_schedule, chunks),
    )


def pipeline_rank_parts(cfg: DictConfig, degrees: Degrees, mesh, model) -> dict[int, RankParts]:
    """What pipeline ranks 1 .. pp - 1 hold, parallelized as rank 0's stages are (under the plan's fake process
    group). Ranks whose stages hold blocks of the same sizes (MoE or dense) and the same ends hold the same shards,
    so each kind is parallelized once: a few kinds however large pp is."""
    from forge.parallel.pipeline import V_SHAPED, build_stage_module, rank_stages, stage_layers, stages_per_rank
    from forge.parallel.plan import parallelize

    parallel = cfg.parallel
    n_stages = degrees.pp * stages_per_rank(parallel.pp_schedule)
    v_shaped = parallel.pp_schedule in V_SHAPED
    layers = stage_layers(len(model.layers), n_stages, v_shaped)
    blocks = {key: sum(p.numel() for p in block.parameters()) for key, block in model.layers.items()}
    kinds: dict[tuple, RankParts] = {}
    held_by: dict[int, RankParts] = {}
    quiet = logging.getLogger("forge")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the transforms were logged once, for rank 0
    try:
        for pp_rank in range(1, degrees.pp):
            held = rank_stages(parallel.pp_schedule, degrees.pp, pp_rank)
            kind = tuple((tuple(blocks[b] for b in layers[s]), s == 0, s == n_stages - 1) for s in held)
            if kind not in kinds:
                parts = [build_stage_module(model, s, n_stages, v_shaped) for s in held]
                for part in parts:
                    parallelize(part, mesh, degrees, parallel, torch.device("cpu"), compute_dtype(cfg))
                kinds[kind] = RankParts.of(parts)
            held_by[pp_rank] = kinds[kind]
    finally:
        quiet.setLevel(level)
    return held_by


def busiest_pipeline_rank(cfg: DictConfig, degrees: Degrees, mesh, model, rank0: MemoryEstimate) -> str:
    """The pipeline rank with the highest estimated peak: stages differ in blocks (uneven splits put the extra ones
    in the middle; MoE blocks may start part way), in the embedding and head they hold, and in the activations
    their schedule keeps in flight. The peak compared is the one this config runs with (full activation
    checkpointing or not), as the layout search takes it."""
    from forge.parallel.pipeline import rank_stages

    parallel = cfg.parallel
    checkpointed = parallel.activation_checkpoint == "full"
    worst, worst_rank, worst_blocks = rank0, 0, 0
    for pp_rank, held in pipeline_rank_parts(cfg, degrees, mesh, model).items():
        mem = rank_memory(cfg, degrees, model.args, held, pp_rank)
        if mem.peak(checkpointed) > worst.peak(checkpointed):
            worst, worst_rank, worst_blocks = mem, pp_rank, held.blocks
    if worst_rank == 0:
        return "busiest pipeline rank: rank 0 (the estimate above is the highest of the pipeline ranks)"
    stages = rank_stages(parallel.pp_schedule, degrees.pp, worst_rank)
    return (
        f"busiest pipeline rank: pipeline rank {worst_rank} (stages {stages}, {worst_blocks} blocks): "
        f"peak {worst.peak(False) / GIB:.2f} GiB without checkpointing, {worst.peak(True) / GIB:.2f} GiB with"
    )


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
        f"ep={degrees.ep} (borrowed from dp_shard={degrees.dp_shard}"
        f"{f' and tp={degrees.tp}' if degrees.ep_spans_tp else ''}; each expert's weights FSDP-sharded over "
        f"{degrees.expert_shard} rank(s)), "
        f"{num // degrees.ep} of {num} experts per rank"
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
