"""The tensor-parallel plan of GPT-2: Megatron-style column/row splits with sequence-parallel LayerNorms.

The residual stream is a DTensor sharded along the sequence between blocks, as Llama's plan leaves it. GPT-2's
projections are Conv1D-layout weights, not nn.Linear, so torch's Colwise/RowwiseParallel do not apply: each one
computes on plain local tensors (forge.parallel.local_tp) with its weight a DTensor, so FSDP2 and DCP see whole
tensors.

- Column-parallel (c_attn, c_fc): the sequence all-gathered, times this rank's output columns: c_attn's (dim, 3,
  dim) weight is Shard(2), so each rank holds q, k and v of its own heads, and its (3, dim) bias Shard(1).
- Row-parallel (c_proj): this rank's input rows (Shard(0)) give partial sums, reduce-scattered along the sequence;
  the replicated bias is added once, to the summed DTensor.
- Token embedding and head split over the vocabulary (the logits stay a DTensor Shard(-1), forge.train.losses);
  the position embedding is replicated, its output a replicated DTensor that the sequence-sharded token embeddings
  add.
"""

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from forge.models.gpt2.model import GPT2, Conv1D
from forge.parallel.applied import Applied, logged
from forge.parallel.expert import local_part
from forge.parallel.local_tp import gather_sequence, replicate_param, scatter_sequence, shard_param


def apply_tensor_parallel(model: GPT2, tp_mesh: DeviceMesh) -> Applied:
    """Split heads and MLP columns over `tp_mesh`; activations between blocks are sharded along the sequence."""
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp_mesh, root_plan)
    model.tie_weights()  # both splits are Shard(0) of the (vocab, dim) matrix: one DTensor serves both
    replicated_embedding(model.pos_embeddings, tp_mesh)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()})
        column_parallel(block.attn.c_attn, tp_mesh)
        row_parallel(block.attn.c_proj, tp_mesh)
        column_parallel(block.mlp.c_fc, tp_mesh)
        row_parallel(block.mlp.c_proj, tp_mesh)
    detail = f"tensor parallel over {tp_mesh.size()} ranks: embedding, {len(model.layers)} GPT-2 blocks (heads and "
    detail += "MLP columns split), norm, output (logits split over the vocabulary)"
    return logged(Applied("tp", detail, {"tp": tp_mesh.size()}))


def column_parallel(conv: Conv1D, mesh: DeviceMesh) -> None:
    """`conv` computes this rank's output features (the last dim of its weight and bias) of the whole sequence."""
    conv.weight = shard_param(conv.weight, mesh, conv.weight.dim() - 1)
    conv.bias = shard_param(conv.bias, mesh, conv.bias.dim() - 1)
    conv.forward = types.MethodType(_column_forward, conv)  # type: ignore[method-assign]


def _column_forward(self: Conv1D, x: DTensor) -> torch.Tensor:
    x = gather_sequence(x, self.weight.device_mesh)
    return x @ local_part(self.weight).flatten(1) + local_part(self.bias).flatten()


def row_parallel(conv: Conv1D, mesh: DeviceMesh) -> None:
    """`conv` takes this rank's input features (column-parallel outputs) and returns the sequence-sharded sum."""
    conv.weight = shard_param(conv.weight, mesh, 0)
    conv.bias = replicate_param(conv.bias, mesh)
    conv.forward = types.MethodType(_row_forward, conv)  # type: ignore[method-assign]


def _row_forward(self: Conv1D, x: torch.Tensor) -> DTensor:
    return scatter_sequence(x @ local_part(self.weight), self.weight.device_mesh) + self.bias


def replicated_embedding(embedding: nn.Embedding, mesh: DeviceMesh) -> None:
    """A replicated embedding looked up with plain indices, its output a replicated DTensor: every rank's gradient
    of it is already whole (the sum with the sequence-sharded stream gathers it), so the weight's is too."""
    embedding.weight = replicate_param(embedding.weight, mesh)
    embedding.forward = types.MethodType(_replicated_embedding_forward, embedding)  # type: ignore[method-assign]


def _replicated_embedding_forward(self: nn.Embedding, indices: torch.Tensor) -> DTensor:
    out = F.embedding(indices, local_part(self.weight))
    return DTensor.from_local(out, self.weight.device_mesh, [Replicate()], run_check=False)
