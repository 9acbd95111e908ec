"""Routed mixture-of-experts: router, grouped experts, dispatch, losses, and the trainer-side helpers. Any family's
blocks may use the layer; the generic machinery (expert parallelism, router balancing, metrics) finds it by type.

Its arguments (forge.models.common.moe.args) import without torch; the layer is imported on first use."""

from forge.lazy import lazy_exports

_BALANCE = "forge.models.common.moe.balance"
__all__ = ["MoE", "has_router_losses", "moe_layers", "moe_metrics", "router_losses", "update_router_biases"]

__getattr__ = lazy_exports(
    __name__,
    {"MoE": "forge.models.common.moe.layer"}
    | {
        name: _BALANCE
        for name in ("has_router_losses", "moe_layers", "moe_metrics", "router_losses", "update_router_biases")
    },
)
