"""The keys and values a decoding model has seen, per layer, so incremental decoding feeds only the new tokens.

Any family whose attention layers pass (cache, layer_id) to forge.models.common.attention.visible_keys decodes
with it (forge-generate, `ModelSpec.generate`)."""

import torch

from forge.models.common.attention import DocumentMask, Mask


class KVCache:
    """Keys and values of the positions already seen, per layer id, so incremental decoding feeds only new tokens."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        """Positions cached so far (the same in every layer)."""
        return next(iter(self.layers.values()))[0].shape[2] if self.layers else 0

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (batch, heads, new, head_dim) keys and values; return all of this layer's so far."""
        if layer_id in self.layers:
            past_k, past_v = self.layers[layer_id]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.layers[layer_id] = (k, v)
        return k, v


def cached_causal_mask(cache: KVCache, seq: int, device: torch.device) -> torch.Tensor:
    """(1, 1, seq, cached + seq): causal over the new positions, aligned to the end of the cached keys."""
    past = cache.length
    keys = torch.arange(past + seq, device=device)
    return (keys[None, :] <= past + torch.arange(seq, device=device)[:, None])[None, None]


def token_positions(
    attn_mask: Mask | DocumentMask,
    cache: KVCache | None,
    positions: torch.Tensor | None,
    seq: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, Mask | DocumentMask]:
    """(positions, mask) of `seq` new tokens: the positions given, else those a DocumentMask's `queries` name (part
    of each sequence: context parallelism), else after the cache's (decoding), else None (0..seq-1); with a cache
    and no mask, the causal mask aligned to the end of the cached keys."""
    if positions is None and isinstance(attn_mask, DocumentMask) and attn_mask.queries is not None:
        positions = attn_mask.queries[None]
    if cache is not None:
        if positions is None:
            positions = torch.arange(cache.length, cache.length + seq, device=device)[None]
        if attn_mask is None:
            attn_mask = cached_causal_mask(cache, seq, device)
    return positions, attn_mask
