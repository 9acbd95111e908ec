"""What the trainer does with the MoE layers of a model: add their losses, update router biases, read loads.

The model stays pure: each MoE layer keeps what its last forward saw, and these functions walk the model.
Per step the trainer calls `router_losses` after each micro-batch's forward (it also tallies that micro-batch's
expert loads), `update_router_biases` after `optimizer.step()`, and `moe_metrics` when it logs.
"""

from collections.abc import Callable

import torch
from torch import nn

from forge.models.common.moe.layer import MoE


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def has_router_losses(model: nn.Module) -> bool:
    """Whether a router adds a loss to the training loss (an aux or z-loss coefficient above 0): what
    `router_losses` sums."""
    return any(args.aux_loss_coef or args.z_loss_coef for args in (layer.args for _, layer in moe_layers(model)))


def router_losses(model: nn.Module) -> torch.Tensor:
    """aux_loss_coef * load-balancing loss + z_loss_coef * z-loss, summed over the MoE layers' last forward.

    Also adds the last forward's expert loads to the step's tally (read by the bias update and the metrics).
    Returns a 0-d zero for a dense model.
    """
    total = torch.zeros(())
    for _, layer in moe_layers(model):
        if layer.last_aux_loss is None:
            continue
        args = layer.args
        total = total.to(layer.last_aux_loss.device)
        if args.aux_loss_coef:
            total = total + args.aux_loss_coef * layer.last_aux_loss
        if args.z_loss_coef:
            total = total + args.z_loss_coef * layer.last_z_loss
        tally = getattr(layer, "step_tally", None)
        rows = [layer.last_routed.float(), layer.last_kept.float()]
        if layer.last_offsets is not None:  # balanced selection: the offsets, and a row of ones that counts them
            rows += [layer.last_offsets.float(), torch.ones_like(layer.last_offsets, dtype=torch.float32)]
        step = torch.stack(rows)
        layer.step_tally = step if tally is None else tally + step
        layer.step_losses = torch.stack([layer.last_aux_loss.detach(), layer.last_z_loss.detach()])
    return total


@torch.no_grad()
def update_router_biases(
    model: nn.Module,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
    for_metrics: bool = True,
    mask: torch.Tensor | None = None,
) -> None:
    """Sigmoid routers: bias += rate * sign(mean_load - load), from this step's tallied loads (DeepSeek-V3); with
    balanced selection, bias += the mean of the step's balancing offsets (over micro-batches and ranks).

    `all_reduce` sums a tensor over the processes in place, so every replica of a router takes the same step; it
    runs once for all layers that need the global loads (the bias updates, and with `for_metrics` every layer, for
    `moe_metrics` on a log step), not once per layer and step. Resets the tally (its last value stays readable as
    `last_step_tally` for the metrics; between log steps a layer without a bias update keeps this rank's loads).
    `mask` (0-dim, 1.0 or 0.0 on the device): the step's update applies only where it is 1.0, as its optimizer
    step's (a non-finite step, decided without a host sync).
    """
    layers = [layer for _, layer in moe_layers(model) if getattr(layer, "step_tally", None) is not None]
    if all_reduce is not None:
        shared = [layer for layer in layers if for_metrics or _updates_bias(layer)]
        if shared:
            flat = torch.cat([layer.step_tally.reshape(-1) for layer in shared])
            all_reduce(flat)
            for layer, summed in zip(shared, flat.split([layer.step_tally.numel() for layer in shared])):
                layer.step_tally = summed.view_as(layer.step_tally)
    for layer in layers:
        tally = layer.step_tally
        layer.last_step_tally, layer.step_tally = tally, None
        if _updates_bias(layer):
            if layer.args.balanced_selection:
                update = tally[2] / tally[3].clamp(min=1)
            else:
                load = tally[0]
                update = layer.args.bias_update_rate * torch.sign(load.mean() - load)
            layer.router.expert_bias.add_(update if mask is None else update * mask.to(update.dtype))


def _updates_bias(layer: MoE) -> bool:
    args = layer.args
    return args.router == "sigmoid_topk" and (args.balanced_selection or bool(args.bias_update_rate))


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Per MoE block: max/min expert load of the last completed step as multiples of the even share (1.0 = balanced)
    and the fraction of assignments dropped by the capacity limit; the router losses of its last micro-batch,
    averaged over the blocks."""
    metrics: dict[str, float] = {}
    aux, z = [], []
    for name, layer in moe_layers(model):
        tally = getattr(layer, "last_step_tally", None)
        if tally is None:
            continue
        label = name.removeprefix("layers.").removesuffix(".feed_forward") or "0"
        routed, kept = tally[0], tally[1]
        share = routed / routed.mean().clamp(min=1e-9)
        metrics[f"moe/{label}/load_max"] = share.max().item()
        metrics[f"moe/{label}/load_min"] = share.min().item()
        metrics[f"moe/{label}/dropped"] = (1 - kept.sum() / routed.sum().clamp(min=1)).item()
        aux.append(layer.step_losses[0].item())
        z.append(layer.step_losses[1].item())
    if aux:
        metrics["moe/aux_loss"] = sum(aux) / len(aux)
        metrics["moe/z_loss"] = sum(z) / len(z)
    return metrics
