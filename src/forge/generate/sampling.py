"""Next-token choice from logits: greedy, or sampling with temperature, top-k and top-p (nucleus)."""

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(batch, vocab) logits with everything outside the top-k and outside the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked before it already hold top_p of the mass (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(batch,) ids chosen from (batch, vocab) logits; temperature 0 is greedy (argmax)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
