"""The attention kernels (TransformerArgs.attention) and the masks each takes.

One rule says which keys a query sees (`allowed`): itself and earlier keys, in the same document of a packed
sample, at most `window` keys back. `dense_attention_mask` evaluates it on the whole (seq, seq) grid for SDPA;
`flex_block_mask` hands it to a compiled create_block_mask, which never holds that grid, for flex_attention, which
skips the blocks the rule rules out. A layer's mask is None (plain causal SDPA), a boolean tensor (SDPA) or a
BlockMask (flex): `attend` runs the kernel the mask is for.

torch 2.13's flex_attention has no backward on CPU (its front end refuses, and inductor's CPU kernel is inference
only). With autograd on CPU, `attend` therefore runs FlexAttention's own eager operator: the same BlockMask and
mask function, unfused, holding (batch, heads, seq, seq) scores. CUDA, and CPU without autograd, run the compiled
kernel.
"""

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

Mask = torch.Tensor | BlockMask | None
"""One layer's mask: None (causal), a boolean (batch, 1, queries, keys) tensor, True where allowed, or a BlockMask."""


@dataclass(frozen=True)
class DocumentMask:
    """Attention within the documents of packed samples, as (batch, seq) document ids (forge.data.documents): the
    model builds each layer's mask from them, for its kernel and its sliding window."""

    doc_ids: torch.Tensor
    """(batch, seq) document ids of the whole sequences (batch may be 1, broadcast)."""
    queries: torch.Tensor | None = None
    """(q,) positions in the sequence of the tokens this forward holds, when it holds only part of each sequence
    (context parallelism, forge.parallel.context_parallel); they are also the tokens' RoPE positions. None: all."""
    keys: torch.Tensor | None = None
    """(k,) positions of the keys attention sees, in the order it sees them (after the context-parallel gather).
    None: the queries'."""


def layer_window(sliding_window: int | list[int | None] | None, layer_id: int) -> int | None:
    """Layer `layer_id`'s window under TransformerArgs.sliding_window (a list is cycled over the layers)."""
    if sliding_window is None or isinstance(sliding_window, int):
        return sliding_window
    return sliding_window[layer_id % len(sliding_window)]


def allowed(doc_ids: torch.Tensor, window: torch.Tensor) -> Callable:
    """The mask function (b, h, q, kv) -> bool: kv at most `window` - 1 positions before q, in q's document.

    The window is a tensor (a full-length one when there is none) and the document ids always exist (zeros without
    documents), so that every mask is one compiled graph of create_block_mask and flex_attention.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        back = q_idx - kv_idx
        return (back >= 0) & (back < window) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return mask_mod


def _window_tensor(window: int | None, seq: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(seq if window is None else window, device=device)


def dense_attention_mask(
    doc_ids: torch.Tensor,
    window: int | None = None,
    queries: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean (B, 1, Q, K) mask for SDPA, True where `allowed`: of every position (S x S), or of the query and key
    positions given (a DocumentMask's, under context parallelism)."""
    batch, seq = doc_ids.shape
    device = doc_ids.device
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    pos = torch.arange(seq, device=device)
    queries = pos if queries is None else queries
    keys = queries if keys is None else keys
    zero = torch.zeros((), dtype=torch.long, device=device)
    rule = allowed(doc_ids, _window_tensor(window, seq, device))
    return rule(b, zero, queries.view(1, 1, -1, 1), keys.view(1, 1, 1, -1))


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # Static shapes: a second shape (another batch or sequence length, a context-parallel part) would otherwise
    # recompile with dynamic sizes, and inductor's CPU kernel of create_block_mask then fails to build (torch 2.13).
    return torch.compile(fn, dynamic=False)


def flex_block_mask(
    doc_ids: torch.Tensor,
    window: int | None = None,
    block_size: int = 128,
    queries: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> BlockMask:
    """FlexAttention BlockMask of `allowed`, built by a compiled create_block_mask (the eager one would evaluate
    the rule on the whole (B, S, S) grid at once); of the query and key positions given, as dense_attention_mask
    (context parallelism: each of a rank's chunks and each rank's gathered keys is a contiguous range, so the
    blocks of a chunk of at least block_size tokens stay as sparse as the whole sequence's)."""
    batch, seq = doc_ids.shape
    rule = allowed(doc_ids, _window_tensor(window, seq, doc_ids.device))
    if queries is None:
        return _compiled(create_block_mask)(rule, batch, None, seq, seq, device=doc_ids.device, BLOCK_SIZE=block_size)
    keys = queries if keys is None else keys

    def part(b, h, q_idx, kv_idx):
        return rule(b, h, queries[q_idx], keys[kv_idx])

    build = _compiled(create_block_mask)
    return build(part, batch, None, len(queries), len(keys), device=doc_ids.device, BLOCK_SIZE=block_size)


def within_window(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """(1, 1, queries, keys): True where a key is fewer than `window` positions before the query, the queries
    being the last `queries` of the keys (decoding with a cache)."""
    query_pos = torch.arange(keys - queries, keys, device=device)
    return (query_pos[:, None] - torch.arange(keys, device=device)[None, :] < window)[None, None]


def layer_masks(
    mask: torch.Tensor | DocumentMask | None,
    windows: Iterable[int | None],
    flex: bool,
    batch: int,
    queries: int,
    device: torch.device,
) -> dict[int | None, Mask]:
    """The mask of each distinct window, built once per forward: from a DocumentMask (or plain causal, None) for
    the kernel (flex: a BlockMask, else dense); an explicit dense mask (generation) is narrowed to each window and
    stays dense, so SDPA runs it under either kernel."""
    masks: dict[int | None, Mask] = {}
    for window in set(windows):
        if isinstance(mask, torch.Tensor):
            masks[window] = mask if window is None else mask & within_window(queries, mask.shape[-1], window, device)
        elif mask is None and window is None and not flex:
            masks[window] = None  # SDPA's own causal mask
        else:
            if mask is not None and mask.queries is not None:  # part of each sequence (context parallelism)
                if flex:  # a BlockMask has a row per sample (one row of ids broadcasts only in a dense mask)
                    doc_ids = mask.doc_ids.expand(batch, -1)
                    masks[window] = flex_block_mask(doc_ids, window, queries=mask.queries, keys=mask.keys)
                else:
                    masks[window] = dense_attention_mask(mask.doc_ids, window, mask.queries, mask.keys)
                continue
            doc_ids = mask.doc_ids if mask is not None else torch.zeros(batch, queries, dtype=torch.long, device=device)
            masks[window] = flex_block_mask(doc_ids, window) if flex else dense_attention_mask(doc_ids, window)
    return masks


def visible_keys(
    k: torch.Tensor, v: torch.Tensor, cache, layer_id: int, gather: Callable | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (batch, kv heads, keys, d) keys and values a layer's queries attend over: these positions', after the
    cache's past ones (decoding: cache.update appends and returns them all) and gathered from the ranks holding
    the sequence's other parts (context parallelism sets the layer's `gather_kv`)."""
    if cache is not None:
        k, v = cache.update(layer_id, k, v)
    if gather is not None:
        k, v = gather(k), gather(v)
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) queries over (batch, kv heads, keys, head_dim) keys and values
    (grouped when there are fewer kv heads) under one layer's mask, by the kernel that mask is for."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _flex_reference(q, k, v, mask)
        return _compiled(flex_attention)(q, k, v, block_mask=mask, enable_gqa=gqa)
    if mask is None:
        return _sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
    if gqa and q.is_cuda:
        # CUDA's masked kernel (memory-efficient) takes no grouped heads: with enable_gqa SDPA would fall back
        # to the math kernel and hold (batch, heads, queries, keys) scores
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        gqa = False
    return _sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)


# On a CPU, torch's bf16 flash kernel is slower than its fp32 one on small attention (benchmarks/attention/
# cpu_bf16_sdpa.py). So at most this many keys x head dim, bf16 attention on a CPU computes in fp32 (no less precise;
# its backward keeps fp32 queries, keys, values and output, twice the bf16 bytes, which --plan's accelerator estimate
# leaves out).
CPU_FP32_ATTENTION_MAX = 256 * 32


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """F.scaled_dot_product_attention, in fp32 where a CPU's bf16 kernel is the slower one (small attention)."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    small = k.shape[-2] * q.shape[-1] <= CPU_FP32_ATTENTION_MAX
    if q.device.type != "cpu" or dtype != torch.bfloat16 or not small:
        return F.scaled_dot_product_attention(q, k, v, **options)
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **options).to(dtype)


def expand_kv_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv heads, keys, d) -> (batch, heads, keys, d): each kv head repeated for its group of query heads,
    as SDPA's enable_gqa groups them (query head h reads kv head h // (heads / kv heads))."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _no_score_mod(score, b, h, q_idx, kv_idx):
    return score


def _flex_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """flex_attention's operator, called eagerly (its math implementation, with a backward on any device) past the
    front-end check that refuses CPU autograd; it expands grouped kv heads itself."""
    options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}  # the backward needs the logsumexp
    out, _, _ = flex_attention_op(q, k, v, _no_score_mod, mask.as_tuple(), q.shape[-1] ** -0.5, options)
    return out
