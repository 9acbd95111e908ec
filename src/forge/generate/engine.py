"""Batched autoregressive generation with a KV cache.

Prompts of different lengths are left-padded; each sequence keeps its own rotary positions (0 at its first real
token) and a mask hides the padding, so a prompt yields the same tokens alone or in a batch.
"""

import torch
from torch import nn

from forge.generate.sampling import next_token
from forge.models.common.kv_cache import KVCache
from forge.models.spec import spec_of


def _left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, is_real) of shape (batch, longest prompt); padding is token 0 on the left."""
    longest = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    real = torch.zeros(len(prompts), longest, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        if prompt:
            tokens[row, longest - len(prompt) :] = torch.tensor(prompt, device=device)
            real[row, longest - len(prompt) :] = True
    return tokens, real


def _mask(real: torch.Tensor, queries: int) -> torch.Tensor:
    """(batch, 1, queries, keys) mask of the last `queries` positions: causal, real keys only.

    A padding query may still see itself, so no row is fully masked (SDPA would return NaN there and the NaN
    would reach later layers' keys).
    """
    keys = real.shape[1]
    key_pos = torch.arange(keys, device=real.device)
    query_pos = torch.arange(keys - queries, keys, device=real.device)
    allowed = (key_pos[None, :] <= query_pos[:, None])[None] & real[:, None, :]
    allowed |= key_pos[None, None, :] == query_pos[None, :, None]
    return allowed[:, None]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """New token ids for each prompt (stopping at eos_id, which is not returned).

    temperature 0 is greedy; `seed` makes sampling reproducible. use_cache=False recomputes the whole sequence at
    every step (the reference the cache is tested against).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    args = getattr(model, "args", None)
    if args is not None and not isinstance(model, nn.ModuleList) and not spec_of(args).generate:
        raise ValueError(f"the {spec_of(args).name} model family does not decode with a KV cache (forge-generate)")
    device = next(model.parameters()).device
    max_len = getattr(args, "max_seq_len", None)
    if max_len is not None and max(len(p) for p in prompts) + max_new_tokens > max_len:
        raise ValueError(f"prompt + max_new_tokens exceeds the model's max_seq_len={max_len}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    tokens, real = _left_pad(prompts, device)
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
    cache = KVCache() if use_cache else None
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    step_tokens, step_positions = tokens, positions
    for _ in range(max_new_tokens):
        queries = step_tokens.shape[1]
        logits = model(step_tokens, attn_mask=_mask(real, queries), cache=cache, positions=step_positions)
        chosen = next_token(logits[:, -1], temperature, top_k, top_p, generator)
        for row in range(len(prompts)):
            if not done[row]:
                if eos_id is not None and chosen[row].item() == eos_id:
                    done[row] = True
                else:
                    out[row].append(int(chosen[row]))
        if bool(done.all()):
            break
        new_position = positions[:, -1:] + 1
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        real = torch.cat([real, torch.ones_like(real[:, :1])], dim=1)
        positions = torch.cat([positions, new_position], dim=1)
        step_tokens, step_positions = (chosen[:, None], new_position) if use_cache else (tokens, positions)
    return out
