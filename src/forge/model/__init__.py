"""Model code: plain PyTorch, no torch.distributed; parallelism is applied from outside."""

from forge.model.args import MoEArgs, RopeScalingArgs, TransformerArgs
from forge.model.transformer import Transformer, build_transformer

__all__ = ["MoEArgs", "RopeScalingArgs", "Transformer", "TransformerArgs", "build_transformer"]
