"""Inference on trained models: KV-cache generation, held-out evaluation and activation capture."""

from forge.generate.engine import generate
from forge.generate.sampling import filter_logits, next_token

__all__ = ["filter_logits", "generate", "next_token"]
