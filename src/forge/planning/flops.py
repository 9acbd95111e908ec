"""Model FLOPs per token, as each model family counts them from its arguments (its spec's cost,
forge.models.spec.ModelCost): matmuls only, 2 FLOPs per multiply-add, a training step 3x the forward."""

from torch import nn

from forge.models.spec import FlopsPerToken, spec_of

__all__ = ["FlopsPerToken", "count_flops_per_token", "model_args", "training_flops_per_token"]


def count_flops_per_token(args, seq_len: int) -> FlopsPerToken:
    """Forward FLOPs per token of a model built from `args` (any family's), on sequences of seq_len tokens."""
    return spec_of(args).cost.flops_per_token(args, seq_len)


def model_args(model: nn.Module):
    """The decoder's arguments of a model (or of a wrapper holding one as `.model`/`.decoder`), else None."""
    for candidate in (model, getattr(model, "decoder", None), getattr(model, "model", None)):
        args = getattr(candidate, "args", None)
        if args is not None and not isinstance(args, dict) and hasattr(args, "n_layers"):
            return args
    return None


def training_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token of the whole model (all shards and stages), or None for an unknown model."""
    args = model_args(model)
    return None if args is None else count_flops_per_token(args, seq_len).training
