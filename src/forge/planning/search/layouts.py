"""Every layout of a world size the search considers: the degrees that multiply to it and suit the model, then
the pipeline schedules and chunks, activation checkpointing modes and micro-batch sizes of each.

A layout here is only a candidate: forge.config.validate (the same checks as a run) passes every row shown.
"""

from collections.abc import Iterator

from forge.config.schema import V_SHAPED, ActivationCheckpoint, PPSchedule
from forge.models.spec import spec_of
from forge.parallel.pipeline import stages_per_rank
from forge.planning.search.cost import Layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def layouts(
    args, world_size: int, global_batch: int, gpus_per_node: int, max_micro: int, seq_len: int | None = None
) -> Iterator[Layout]:
    """Candidates for a model of `args`: tp within a node and dividing the (key/value) heads, pp up to the
    blocks (stages may differ by a block), cp a power of two with tp x cp within a node, dividing seq_len into
    2 x cp chunks (none when seq_len is not given), ep dividing the experts and dp_shard (MoE only;
    under tp an MoE's expert width must split over it), every split of the data-parallel ranks into
    dp_replicate x dp_shard, micro-batches dividing each rank's share of the batch."""
    moe, supported = getattr(args, "moe", None), spec_of(args).parallel
    expert_width = (moe.expert_ffn_dim or args.hidden_dim) if moe is not None else 0
    kv_heads = getattr(args, "kv_heads", args.n_heads)
    for tp in divisors(world_size) if "tp" in supported else [1]:
        if tp > gpus_per_node or args.n_heads % tp or kv_heads % tp or (moe is not None and expert_width % tp):
            continue
        for pp in divisors(world_size // tp) if "pp" in supported else [1]:
            if args.n_layers < pp:
                continue
            cps = context_degrees(args, world_size // tp // pp, pp, gpus_per_node // tp, seq_len)
            for cp in cps if "cp" in supported else [1]:
                dp = world_size // tp // pp // cp
                if global_batch % dp:
                    continue
                per_rank = global_batch // dp
                for dp_replicate in divisors(dp):
                    dp_shard = dp // dp_replicate
                    split = moe is not None and "ep" in supported  # ep composes with tp, pp and cp
                    eps = [e for e in divisors(dp_shard) if moe.num_experts % e == 0] if split else [1]
                    for ep in eps:
                        for micro in powers_of_two(min(per_rank, max_micro)):
                            if per_rank % micro:
                                continue
                            yield from _with_schedules(args, dp_replicate, dp_shard, tp, pp, ep, micro, cp)


def context_degrees(args, ranks: int, pp: int, per_node: int, seq_len: int | None) -> list[int]:
    """The cp degrees forge.config.validate accepts here (1 always)."""
    if seq_len is None:
        return [1]
    return [cp for cp in powers_of_two(min(ranks, max(per_node, 1))) if ranks % cp == 0 and seq_len % (2 * cp) == 0]


def _with_schedules(args, dp_replicate, dp_shard, tp, pp, ep, micro, cp=1) -> Iterator[Layout]:
    for mode in (m.value for m in ActivationCheckpoint):
        if pp == 1:
            yield Layout(dp_replicate, dp_shard, tp, pp, ep, mode, micro, cp=cp)
            continue
        for schedule in (s.value for s in PPSchedule):
            if args.n_layers < pp * stages_per_rank(schedule):
                continue
            if schedule in V_SHAPED and getattr(args, "tie_embeddings", False):
                continue
            for chunks in (pp, 2 * pp, 4 * pp):
                if micro % chunks == 0:
                    yield Layout(dp_replicate, dp_shard, tp, pp, ep, mode, micro, schedule, chunks, cp)
