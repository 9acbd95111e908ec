"""forge-train: a Hydra-composed trainer for decoder LLMs, MoE and vision-language models."""

__version__ = "0.1.0"
