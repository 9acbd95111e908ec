"""forge-train: a Hydra-composed trainer for decoder LLMs, MoE and vision-language models."""

__version__ = "0.1.0"


def load_pretrained(path):
    """Our model with its weights, on CPU, in eval mode: from a run directory, a checkpoint folder, a consolidated
    file or a Hugging Face folder. Calling it on token ids returns logits."""
    from forge.checkpoint.convert import load_pretrained as _load

    return _load(path)
