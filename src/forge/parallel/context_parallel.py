"""Context parallelism: each sequence split over the cp ranks, keys and values all-gathered in every attention layer.

Causal attention costs a late position more than an early one, so the sequence is cut into 2 x cp chunks and cp
rank r holds chunks r and 2cp-1-r, a head and a tail: every rank does the same work (the load balancing of Llama 3
and torchtitan). Each attention layer all-gathers the keys and values of the cp group (the Llama 3 approach rather
than a ring: document masks, sliding windows and grouped kv heads stay one plain mask) and the backward
reduce-scatters their gradients. A rank's tokens keep their positions in the whole sequence, which RoPE and the
mask read from the `DocumentMask` the split hands the model (its `queries` and `keys`).

Per layer and rank that costs the whole sequence's keys and values (2 x seq x kv_heads x head_dim, as one process
holds them) and a (batch, 1, seq / cp, seq) boolean mask; the queries, activations and logits are 1 / cp.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge.models.common.attention import DocumentMask
from forge.parallel.applied import Applied, logged


def chunk_positions(seq: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions of the sequence that cp rank `rank` holds: chunks rank and 2cp-1-rank of 2cp equal chunks."""
    chunk = seq // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


def gathered_positions(seq: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions of the keys after the all-gather: rank 0's, then rank 1's, ... (a permutation of 0..seq-1)."""
    return torch.cat([chunk_positions(seq, cp, rank, device) for rank in range(cp)])


class ContextSplit:
    """This rank's part of every sequence of a batch, and the mask that places it in the whole sequence."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()

    def queries(self, seq: int, device: torch.device | None = None) -> torch.Tensor:
        return chunk_positions(seq, self.size, self.rank, device)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of this rank's positions (labels are already shifted: position t's label is token t+1)."""
        return labels[:, self.queries(labels.shape[1], labels.device)]

    def shard(
        self, inputs: torch.Tensor, labels: torch.Tensor, attn_mask: DocumentMask | None
    ) -> tuple[torch.Tensor, torch.Tensor, DocumentMask]:
        """(inputs, labels, mask) of this rank's positions. Without documents the mask is plain causal, over
        document ids of one row (broadcast over the batch)."""
        seq, device = inputs.shape[1], inputs.device
        queries = self.queries(seq, device)
        doc_ids = attn_mask.doc_ids if attn_mask is not None else torch.zeros(1, seq, dtype=torch.long, device=device)
        mask = DocumentMask(doc_ids, queries=queries, keys=gathered_positions(seq, self.size, device))
        return inputs[:, queries], labels[:, queries], mask


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension (2) of (batch, heads, seq, head_dim); backward reduce-scatters the
    gradient (each rank's keys were read by every rank's queries)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        batch, heads, seq, dim = x.shape
        out = x.new_empty((world * batch, heads, seq, dim))  # the ranks' tensors one after another (gloo's layout)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(world, batch, heads, seq, dim).permute(1, 2, 0, 3, 4).reshape(batch, heads, world * seq, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        batch, heads, total, dim = grad.shape
        parts = grad.reshape(batch, heads, world, total // world, dim).permute(2, 0, 1, 3, 4).contiguous()
        out = grad.new_empty((batch, heads, total // world, dim))
        dist.reduce_scatter_tensor(out, parts.flatten(0, 1), group=ctx.group)
        return out, None


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> Applied:
    """Make every attention layer gather the keys and values of the whole sequence from the cp group: the layers
    that declare a `gather_kv` slot (forge.models.spec's module protocol)."""
    group = cp_mesh.get_group()
    layers = [module for module in model.modules() if hasattr(module, "gather_kv")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layer with a gather_kv slot for context parallelism")
    for attention in layers:
        attention.gather_kv = lambda t: _GatherSequence.apply(t, group)
    detail = (
        f"context parallel over {cp_mesh.size()} ranks: {len(layers)} attention layers all-gather keys and values; "
        "each rank holds 2 of the sequence's 2 x cp chunks"
    )
    return logged(Applied("cp", detail, {"cp": cp_mesh.size()}))
