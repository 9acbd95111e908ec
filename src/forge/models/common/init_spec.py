"""Initial values as a function of (seed, parameter name, row block) only, so any piece of a weight can be filled
on its own.

A parameter's rows (dim 0; the expert index of a stacked expert weight) are cut into blocks of about
`BLOCK_ELEMENTS` elements. Block b is drawn from a CPU generator seeded from (seed, name, b) with the parameter's
distribution. A shard holding rows [r0, r1) and some columns draws only the blocks overlapping its rows and keeps
its columns, so one process and every parallel layout get bitwise the same values without any collective, and a
rank draws about its own share of the random numbers. Drawing on the CPU makes CPU and GPU runs agree as well.
"""

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

BLOCK_ELEMENTS = 2**16
"""Elements per row block. Small enough that a 512-way shard of a 70B model's matrices (a few rows each) wastes
little of the block it shares with its neighbours, large enough that seeding a generator per block costs nothing."""


@dataclass(frozen=True)
class InitSpec:
    """How one parameter (or buffer) starts. trunc_normal cuts at +-3 std; ones and zeros draw nothing."""

    kind: Literal["normal", "trunc_normal", "ones", "zeros"]
    std: float = 0.0

    @property
    def random(self) -> bool:
        return self.kind in ("normal", "trunc_normal")

    def draw(self, out: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Fill `out` in place from `generator` (the global one when None)."""
        if self.kind == "normal":
            nn.init.normal_(out, std=self.std, generator=generator)
        elif self.kind == "trunc_normal":
            nn.init.trunc_normal_(out, std=self.std, a=-3 * self.std, b=3 * self.std, generator=generator)
        elif self.kind == "ones":
            nn.init.ones_(out)
        else:
            nn.init.zeros_(out)


ONES = InitSpec("ones")
ZEROS = InitSpec("zeros")


def trunc_normal(std: float) -> InitSpec:
    return InitSpec("trunc_normal", std)


def prefixed(prefix: str, specs: dict[str, InitSpec]) -> dict[str, InitSpec]:
    """A submodule's specs under its name in the parent."""
    return {f"{prefix}.{name}": spec for name, spec in specs.items()}


def apply_specs(module: nn.Module, specs: dict[str, InitSpec]) -> None:
    """Draw each named tensor of `module` from the global generator, in the order of `specs` (the modules' own
    `init_weights`, for models initialised as a whole without a seed)."""
    for name, spec in specs.items():
        spec.draw(tensor_at(module, name))


def tensor_at(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` (dotted) of `module`."""
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner), attr)


def block_rows(global_shape: Sequence[int]) -> int:
    """Rows (along dim 0) of one block of a tensor of `global_shape`."""
    return max(1, BLOCK_ELEMENTS // math.prod(global_shape[1:]))


def scratch_elements(global_shape: Sequence[int]) -> int:
    """fp32 elements of the scratch `fill_piece_` allocates for a parameter of `global_shape`: two blocks (the
    values, and the redraws of a truncated normal). The host memory initialisation needs beyond the shards."""
    if len(global_shape) == 0:
        return 2
    return 2 * min(block_rows(global_shape), global_shape[0]) * math.prod(global_shape[1:])


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of one block: stable across processes, machines and Python runs (no hash())."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the block-sized ops on one thread: waking intra-op threads for 2**16 elements costs more than the work,
    most of all on a busy host. The values do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def fill_piece_(
    out: torch.Tensor,
    spec: InitSpec,
    seed: int,
    name: str,
    global_shape: Sequence[int],
    offset: Sequence[int],
) -> int:
    """Write into `out` its values as the piece of the `global_shape` tensor `name` starting at `offset` (one index
    per dim; `out` is a contiguous rectangle of the whole). Returns how many random numbers it drew."""
    if out.numel() == 0:
        return 0
    if not spec.random:
        spec.draw(out)
        return 0
    generator = torch.Generator(device="cpu")
    if len(global_shape) == 0:
        generator.manual_seed(block_seed(seed, name, 0))
        value = torch.empty((), dtype=torch.float32)
        _draw_block(value, spec, generator, torch.empty_like(value))
        out.copy_(value)
        return 1
    rows, width = block_rows(global_shape), math.prod(global_shape[1:])
    first, last = offset[0], offset[0] + out.shape[0]
    columns = (slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:])))
    # One pair of scratch buffers for every block: fresh allocations of this size go to mmap and page faults,
    # which cost more than the drawing on some hosts. fp32 whatever the parameter's dtype: a bf16 draw would give
    # other values than an fp32 one.
    scratch = torch.empty(2, scratch_elements(global_shape) // 2, dtype=torch.float32)
    drawn = 0
    with _one_thread():
        for block in range(first // rows, math.ceil(last / rows)):
            start, stop = block * rows, min((block + 1) * rows, global_shape[0])
            size = (stop - start) * width
            values = scratch[0, :size].view(stop - start, *global_shape[1:])
            generator.manual_seed(block_seed(seed, name, block))
            _draw_block(values, spec, generator, scratch[1, :size].view_as(values))
            drawn += size
            lo, hi = max(start, first), min(stop, last)
            out[lo - first : hi - first].copy_(values[lo - start : hi - start][columns])
    return drawn


def _draw_block(values: torch.Tensor, spec: InitSpec, generator: torch.Generator, fresh: torch.Tensor) -> None:
    """Draw one block in place: normal, or truncated normal by redrawing the values outside +-3 std (as
    nn.init.trunc_normal_ does, without allocating a block per round)."""
    values.normal_(0.0, spec.std, generator=generator)
    if spec.kind != "trunc_normal":
        return
    bound = 3 * spec.std
    while True:
        outside = (values < -bound) | (values > bound)
        if not outside.any():
            return
        fresh.normal_(0.0, spec.std, generator=generator)
        torch.where(outside, fresh, values, out=values)


def fill_whole_(tensor: torch.Tensor, spec: InitSpec, seed: int, name: str) -> int:
    """`fill_piece_` of a tensor that is the whole parameter."""
    return fill_piece_(tensor, spec, seed, name, tuple(tensor.shape), (0,) * tensor.dim())
