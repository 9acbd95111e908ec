"""Record chosen modules' outputs (by name pattern) over a few batches, and save them as safetensors."""

import fnmatch
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def matching_modules(model: nn.Module, patterns: list[str]) -> dict[str, nn.Module]:
    """Modules whose qualified name matches any of the patterns, segment by segment between dots: `layers.*` is
    every block (not their submodules), `layers.*.attention` every attention, `layers.1` one block."""

    def matches(name: str, pattern: str) -> bool:
        parts, wanted = name.split("."), pattern.split(".")
        return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, wanted))

    found = {name: m for name, m in model.named_modules() if name and any(matches(name, p) for p in patterns)}
    if not found:
        raise ValueError(f"no module name matches {patterns}")
    return found


@torch.no_grad()
def capture_activations(
    model: nn.Module, batches: Iterable[torch.Tensor], patterns: list[str]
) -> dict[str, torch.Tensor]:
    """{module name: its outputs over all batches, concatenated on the batch dimension} (fp32, on CPU).

    Each batch is a (batch, seq) token tensor; a module returning a tuple contributes its first element.
    """
    recorded: dict[str, list[torch.Tensor]] = {}

    def hook(name: str):
        def record(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            recorded.setdefault(name, []).append(out.detach().float().cpu())

        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in matching_modules(model, patterns).items()]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for tokens in batches:
            model(tokens.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {name: torch.cat(parts) for name, parts in recorded.items()}


def save_activations(activations: dict[str, torch.Tensor], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in activations.items()}, str(path))
