"""Tensor-parallel styles for float8 linears (parallel.fp8 with parallel.tp > 1): torchao's, and on gloo a row-wise
one whose output gradient is gathered before its float8 cast.

torchao's float8 styles cast a module's input to float8 before its all-gather and the row-wise output's gradient
before its backward all-gather, halving those collectives' bytes on GPUs; the casts' scales come from the whole
tensors (an all-reduce of the amax), so every rank scales as one process would. gloo has no float8 collectives: on
a CPU mesh the inputs are gathered in the compute dtype (torch's PrepareModuleInput) and cast after, and the
row-wise output's gradient likewise (`GatherThenCastRowwiseParallel`), which keeps the same scales.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel


def tensor_parallel_styles(tp_mesh: DeviceMesh, *inputs_of: nn.Module) -> tuple[type, type, type]:
    """(column-wise, row-wise, input-preparing) styles for a group of linears reading one gathered input: the float8
    ones when they are all float8 linears, else torch's."""
    if not all(type(module).__name__ == "Float8Linear" for module in inputs_of):
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (  # optional: only under parallel.fp8
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    if tp_mesh.device_type == "cpu":
        return Float8ColwiseParallel, gather_then_cast_rowwise(Float8RowwiseParallel), PrepareModuleInput
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def gather_then_cast_rowwise(base: type) -> type:
    """torchao's Float8RowwiseParallel (`base`) with its output's gradient cast to float8 after the backward of the
    output's redistribution (an all-gather in the compute dtype), not before."""
    from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic

    def prepare_output(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = NoopFwToFloat8BwDynamic.apply(
            outputs, mod.linear_mm_config, mod.config.cast_config_grad_output.target_dtype
        )
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
        return outputs.to_local() if use_local_output else outputs

    return type("GatherThenCastRowwiseParallel", (base,), {"_prepare_output_fn": staticmethod(prepare_output)})
