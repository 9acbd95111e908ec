"""The training losses' options (conf/loss), without torch: the config schemas extend these dataclasses, so a config
composes, and a bad one is refused, before torch is imported. forge.train.losses gives each its computation."""

from dataclasses import dataclass

from forge.domain import domain


@dataclass
class CrossEntropyOptions:
    """Mean token cross-entropy of the logits, plus an optional z-loss."""

    z_loss_weight: float = domain(0.0, ge=0, means="0: off")
    """Weight of PaLM's z-loss, mean(logsumexp(logits)^2) over labelled tokens (1e-4 in PaLM; 0 = off)."""


@dataclass
class ChunkedCrossEntropyOptions:
    """Cross-entropy with the output head applied a chunk of tokens at a time."""

    chunk_size: int = domain(1024, ge=1)
    """Tokens (over batch x sequence) per chunk of the head and loss."""
    z_loss_weight: float = domain(0.0, ge=0, means="0: off")
    """Weight of PaLM's z-loss, mean(logsumexp(logits)^2) over labelled tokens (1e-4 in PaLM; 0 = off)."""

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be positive")
