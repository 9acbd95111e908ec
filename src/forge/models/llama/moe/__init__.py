"""Routed mixture-of-experts: router, grouped experts, dispatch, losses, and the trainer-side helpers."""

from forge.models.llama.moe.balance import (
    has_router_losses,
    moe_layers,
    moe_metrics,
    router_losses,
    update_router_biases,
)
from forge.models.llama.moe.layer import MoE

__all__ = ["MoE", "has_router_losses", "moe_layers", "moe_metrics", "router_losses", "update_router_biases"]
