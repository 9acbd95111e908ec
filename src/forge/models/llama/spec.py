"""The Llama family's spec: dense, MoE and latent-attention decoders (Llama 3, Qwen3, Mixtral, Qwen3-MoE,
DeepSeek-V3 shapes), what the generic machinery reads of it (forge.models.spec)."""

from forge.models.llama.args import TransformerArgs
from forge.models.llama.check import check
from forge.models.llama.cost import LlamaCost
from forge.models.llama.hf import LlamaHF
from forge.models.llama.parallelize import apply_tensor_parallel
from forge.models.llama.transformer import Transformer
from forge.models.spec import PARALLEL_DIMS, ModelSpec

SPEC = ModelSpec(
    name="llama",
    args=TransformerArgs,
    build=Transformer,
    check=check,
    tensor_parallel=apply_tensor_parallel,
    cost=LlamaCost(),
    hf=LlamaHF(),
    parallel=frozenset(PARALLEL_DIMS),
    generate=True,
    aliases=("forge.model.args.TransformerArgs",),  # before the model families had folders
)
