"""Routed experts as stacked 3-D weights, so expert parallelism can keep a slice of the leading dimension.

Layout matches `torch._grouped_mm(x, w)` (x @ w): w1 and w3 are (experts, dim, hidden), w2 is (experts, hidden, dim).
Tokens arrive grouped by expert: rows [0, counts[0]) go to the first local expert, and so on. Rows past counts.sum()
(assignments a capacity limit dropped) ride with the last expert, so every shape stays static and nothing waits on
the device; the layer weighs their outputs by 0, which also gives them a zero gradient. (On a CPU, where reading a
value waits for nothing, balanced groups are padded to the longest one and run as batched GEMMs: see
BATCHED_PADDING_LIMIT.)
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.init_spec import InitSpec, trunc_normal

WeightView = Callable[[torch.Tensor], torch.Tensor]
"""Maps a stacked expert weight to the plain tensor of this process's experts (expert parallelism passes one)."""


def grouped_mm_available() -> bool:
    """torch._grouped_mm exists in this build (CUDA sm90+, and CPU in recent releases)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm_fits(device: torch.device, dtype: torch.dtype, *widths: int) -> bool:
    """The grouped GEMM kernels run this case: bf16 off the CPU and under torch.compile, whose shape rules are
    CUDA's (the CPU kernel takes any float), and 16-byte row strides, each width a multiple of 16 bytes' worth of
    elements."""
    if dtype != torch.bfloat16 and (device.type != "cpu" or torch.compiler.is_compiling()):
        return False
    per_row = max(16 // torch.empty(0, dtype=dtype).element_size(), 1)
    return all(width % per_row == 0 for width in widths)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's where it is on for x's device, else x's."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def group_alignment(x: torch.Tensor) -> int:
    """Rows per expert group the grouped GEMM needs: 1 on a CPU; on CUDA 16 bytes' worth (8 rows in bf16), because
    the weight gradient's grouped GEMM runs along the token dimension."""
    return max(16 // x.element_size(), 1) if x.is_cuda else 1


def group_sizes(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows per group, the last group also taking the rows past counts.sum() (dropped assignments)."""
    extra = rows - counts.sum()
    return counts + F.pad(extra.view(1), (counts.numel() - 1, 0))


def padded_positions(sizes: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's place when every group is padded to a multiple of `align` rows (at least `align`), and the padded
    groups' end offsets. All on the device: the padded buffer has the static size rows + groups * align."""
    padded = ((sizes + align - 1) // align * align).clamp(min=align)
    ends = padded.cumsum(0)
    return group_positions(sizes, rows, ends - padded), ends


def group_positions(sizes: torch.Tensor, rows: int, padded_starts: torch.Tensor) -> torch.Tensor:
    """Each row's place in a buffer whose group g starts at row padded_starts[g]."""
    starts = sizes.cumsum(0) - sizes
    group = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes, output_size=rows)
    return torch.arange(rows, device=sizes.device) - starts[group] + padded_starts[group]


class GroupedExperts(nn.Module):
    """`num_local` SwiGLU experts out of `num_experts`, starting at global id `first`."""

    def __init__(self, dim: int, hidden: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts, self.first, self.num_local = num_experts, 0, num_experts
        self.use_grouped_mm = use_grouped_mm and grouped_mm_available()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def keep_slice(self, first: int, count: int) -> None:
        """Keep only experts [first, first + count) (works on the meta device too); used by expert parallelism."""
        for name in ("w1", "w2", "w3"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[first : first + count].clone()))
        self.first, self.num_local = first, count

    def forward(self, x: torch.Tensor, counts: torch.Tensor, view: WeightView | None = None) -> torch.Tensor:
        """x (N, dim) grouped by local expert, counts (num_local,) int64 -> (N, dim).

        Grouped GEMMs where the build has them and the widths fit their strides (on a CPU, batched GEMMs of the
        padded groups when routing is balanced); otherwise one matmul chain per expert. `view` is applied to w1, w2
        and w3 inside forward (after any wrapper's pre-forward hook gathered them): expert parallelism passes one
        that returns the local part of its sharded parameters.
        """
        weights = (view(self.w1), view(self.w2), view(self.w3)) if view is not None else None
        w1 = weights[0] if weights is not None else self.w1
        if self.use_grouped_mm and grouped_mm_fits(x.device, compute_dtype(x), *w1.shape[-2:]):
            return self.forward_grouped(x, counts, weights)
        return self.forward_loop(x, counts, weights)

    def forward_loop(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """One matmul chain per expert: the reference path (any dtype, any device, any width; reads the counts on
        the host); weights: (w1, w2, w3)."""
        w1, w2, w3 = weights or (self.w1, self.w2, self.w3)
        outs = []
        for e, chunk in enumerate(x.split(group_sizes(counts, x.shape[0]).tolist())):
            h = F.silu(chunk @ w1[e]) * (chunk @ w3[e])
            outs.append(h @ w2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    def forward_grouped(
        self, x: torch.Tensor, counts: torch.Tensor, weights: tuple | None = None, align: int | None = None
    ) -> torch.Tensor:
        """All experts in three grouped GEMMs, without a host sync. Groups are padded to `align` rows only where the
        kernel needs it (`group_alignment`: on CUDA); the padded buffer's size is static. On a CPU, near-equal groups
        are padded to the longest (read on the host) and run as three batched GEMMs instead (`batched_swiglu`)."""
        w1, w2, w3 = weights or (self.w1, self.w2, self.w3)
        dtype = compute_dtype(x)
        x, w1, w2, w3 = x.to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype)
        rows, sizes = x.shape[0], group_sizes(counts, x.shape[0])
        align = group_alignment(x) if align is None else align
        if align == 1 and x.device.type == "cpu" and not torch.compiler.is_compiling():
            longest = int(sizes.max())  # a CPU reads its own memory: there is no device to wait for
            if 0 < longest * sizes.numel() <= rows * BATCHED_PADDING_LIMIT:
                return batched_swiglu(x, sizes, longest, w1, w2, w3)
        if align == 1:
            return grouped_swiglu(x, sizes.cumsum(0).to(torch.int32), w1, w2, w3)
        position, ends = padded_positions(sizes, rows, align)
        padded = x.new_zeros(rows + sizes.numel() * align, x.shape[-1]).index_copy(0, position, x)
        return take_rows(grouped_swiglu(padded, ends.to(torch.int32), w1, w2, w3), position)

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        return {"w1": trunc_normal(std), "w3": trunc_normal(std), "w2": trunc_normal(out_std)}

    def init_weights(self, std: float, out_std: float) -> None:
        """Draw every global expert in order from the global generator and keep the local ones, so a slice
        initialises like the whole."""
        for name, spec in self.init_specs(std, out_std).items():
            param = getattr(self, name)
            scratch = torch.empty(param.shape[1:], device=param.device, dtype=param.dtype)
            for e in range(self.num_experts):
                spec.draw(scratch)
                local = e - self.first
                if 0 <= local < self.num_local:
                    with torch.no_grad():
                        param[local].copy_(scratch)


BATCHED_PADDING_LIMIT = 1.25
"""On a CPU, groups padded to the longest run as batched GEMMs when the padding adds at most this factor of rows
(balanced routing: a few percent). torch._grouped_mm runs one GEMM per group there, and batched GEMMs of the padded
groups took 0.78x its time at 64 groups of 192 x 512 rows (benchmarks/moe/speed.py measures the step). Autograd then
keeps the padded tokens and hidden states, up to this factor of what forge.planning.memory counts for them."""


def batched_swiglu(
    x: torch.Tensor, sizes: torch.Tensor, longest: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """`grouped_swiglu` with every group padded to `longest` rows and run as batched GEMMs (rows of zeros: their
    outputs are dropped and give no gradient)."""
    groups = sizes.numel()
    position = group_positions(sizes, x.shape[0], torch.arange(groups, device=x.device) * longest)
    padded = x.new_zeros(groups * longest, x.shape[-1]).index_copy(0, position, x).view(groups, longest, x.shape[-1])
    h = F.silu(torch.bmm(padded, w1)) * torch.bmm(padded, w3)
    return take_rows(torch.bmm(h, w2).view(groups * longest, w2.shape[-1]), position)


def take_rows(y: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """y[position] for `position` naming distinct rows (a padded buffer's real rows)."""
    return _TakeRows.apply(y, position)


class _TakeRows(torch.autograd.Function):
    """y[position] for `position` naming distinct rows: its backward copies the gradient into those rows (indexing's
    own backward accumulates, as for repeated indices, several times slower on a CPU)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(position)
        ctx.rows = y.shape[0]
        return y.index_select(0, position)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (position,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, grad.shape[-1]).index_copy(0, position, grad), None


def grouped_swiglu(
    x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each row group [offs[g-1], offs[g]) with expert g's weights."""
    h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
    return torch._grouped_mm(h, w2, offs=offs)
