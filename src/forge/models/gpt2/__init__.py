"""GPT-2 (OpenAI's decoder, as transformers' GPT2LMHeadModel): learned positions, pre-LayerNorm blocks with biased
projections in Conv1D layout and a tanh-GELU MLP, the head tied to the token embedding.

One folder holds the family: `args` (GPT2Args, the conf/model schema; imports without torch), `model` (the module),
`parallelize` (its tensor-parallel plan), `cost` (FLOPs and memory), `hf` (the Hugging Face adapter) and `spec`
(what the generic machinery reads, forge.models.spec).
"""
