"""Resolve the parallel degrees of a config against a world size."""

from dataclasses import dataclass

from forge.config.errors import ConfigError


@dataclass(frozen=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    cp: int = 1
    ep_spans_tp: bool = False
    """parallel.ep_spans_tp: the ep ranks are ep / tp dp_shard ranks times the tp ranks."""

    @property
    def ep_data(self) -> int:
        """The dp_shard ranks expert parallelism borrows (ep, or ep / tp when it spans the tp ranks too)."""
        return self.ep // self.tp if self.ep_spans_tp and self.ep > 1 else self.ep

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees different data (context-parallel peers share theirs)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards parameters over: dp_shard x cp (context-parallel ranks join the shard group, as in
        torchtitan, since they hold the same parameters)."""
        return self.dp_shard * self.cp

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP shards one rank's experts over (without ep, all its experts are sharded like the rest): the
        dp_shard / ep_data ranks that hold the same experts, times cp (context-parallel peers route other tokens to
        them)."""
        return self.dp_shard // self.ep_data * self.cp

    @property
    def token_ranks(self) -> int:
        """Ranks that hold different tokens of a step: dp x cp. Gradients are averaged over them."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp


def defers_grad_sync(degrees: Degrees, pp_schedule: str, explicit: bool | None = None) -> bool:
    """Whether gradients are reduced once per step rather than after each micro-batch (or pipeline chunk):
    `explicit` (parallel.defer_grad_sync), or when None, where the parameters are not sharded (DDP), and under a
    zero-bubble pipeline schedule, whose weight gradients come after the input ones (FSDP reduces the stage when
    the schedule's step ends, with its parameters kept unsharded through the step)."""
    from forge.config.schema import ZERO_BUBBLE

    if explicit is not None:
        return bool(explicit)
    return degrees.fsdp_shard == 1 or (degrees.pp > 1 and str(pp_schedule) in ZERO_BUBBLE)


def pipeline_chunks(pp: int, microbatches: int | None) -> int:
    """The chunks a pipeline splits each micro-batch into: parallel.microbatches, or when None one per pipeline rank
    (1 without a pipeline)."""
    return (microbatches or pp) if pp > 1 else 1


def resolve_degrees(parallel, world_size: int) -> Degrees:
    """Fill the one degree set to -1 and check that the product equals the world size.

    Expert parallelism borrows ranks from the data-parallel shard dimension (as in torchtitan), so `ep` does not
    enter the product; forge.config.validate checks that it divides dp_shard.
    """
    sizes = {k: int(parallel.get(k, 1)) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"only one parallel degree may be -1, got {', '.join('parallel.' + k for k in free)}")
    for key, value in sizes.items():
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{key}={value} must be a positive integer or -1")
    fixed = 1
    for value in sizes.values():
        if value != -1:
            fixed *= value
    if free:
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not divisible by the fixed parallel degrees "
                + " x ".join(f"parallel.{k}={v}" for k, v in sizes.items() if v != -1)
            )
        sizes[free[0]] = world_size // fixed
    degrees = Degrees(ep=int(parallel.ep), ep_spans_tp=bool(parallel.get("ep_spans_tp", False)), **sizes)
    if degrees.world_size != world_size:
        raise ConfigError(
            "the product of the parallel degrees "
            + " x ".join(f"parallel.{k}={v}" for k, v in sizes.items())
            + f" = {degrees.world_size} does not equal the world size {world_size}"
        )
    if degrees.ep < 1:
        raise ConfigError(f"parallel.ep={degrees.ep} must be a positive integer")
    return degrees
