"""Model code: plain PyTorch, no torch.distributed; parallelism is applied from outside.

The model's arguments import without torch (the config schemas extend them); the model is imported on first use."""

from forge.lazy import lazy_exports
from forge.models.llama.args import MoEArgs, RopeScalingArgs, TransformerArgs

__all__ = ["MoEArgs", "RopeScalingArgs", "Transformer", "TransformerArgs", "build_transformer"]

__getattr__ = lazy_exports(
    __name__, {name: "forge.models.llama.transformer" for name in ("Transformer", "build_transformer")}
)
