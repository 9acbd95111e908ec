"""One pass over the composed config that rejects impossible combinations before anything is allocated."""

from __future__ import annotations

import dataclasses
import importlib.util

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from forge.config.degrees import Degrees, pipeline_chunks, resolve_degrees
from forge.config.domains import validate_domains
from forge.config.errors import ConfigError, require
from forge.config.interpolations import validate_interpolations
from forge.config.resolve import composed_from, fill_micro_batch, fill_vocab_from_data_meta, read_only
from forge.config.schema import (
    V_SHAPED,
    ZERO_BUBBLE,
    MemmapDataConfig,
    VLMDataConfig,
    stages_per_rank,
)
from forge.models.spec import PARALLEL_DIMS, spec_of
from forge.models.vlm.args import POOLING_CONNECTORS
from forge.parallel.env import read_dist_env


def _refuse_each(refused: dict[str, bool], message: str) -> None:
    """Refuse the first combination in `refused` ({what: applies}) that applies: `message` with it as {what}."""
    for what, applies in refused.items():
        require(not applies, message.format(what=what))


def cuda_available() -> bool:
    import torch  # here, not at the top: most configs are checked (and most errors refused) without torch

    return torch.cuda.is_available()


def config_groups() -> tuple[str, ...]:
    """The top-level keys of forge-train's config: the groups of conf/train.yaml's defaults list."""
    import yaml

    from forge.config.paths import conf_dir

    defaults = yaml.safe_load((conf_dir() / "train.yaml").read_text())["defaults"]
    groups = (next(iter(entry)) for entry in defaults if isinstance(entry, dict))
    return tuple(group for group in groups if group not in GLOBAL_GROUPS)


GLOBAL_GROUPS = ("experiment", "debug", "hparams_search")
"""Groups whose options are `# @package _global_`: they set keys of other groups and have no key of their own."""


OPTIONAL_GROUPS = ("loss", "vlm", "search")
"""Config groups a run may leave out (`~loss`: plain cross-entropy; vlm and search are off unless named)."""


def null_group_refusal(overrides: list[str]) -> str | None:
    """The line refusing `train=null` (any config group set to null), which Hydra fails on with a traceback ("Config
    group override must be a string or a list"); None when no override does that."""
    from forge.config.paths import conf_dir

    groups = config_groups()
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key not in groups or value.strip().lower() not in ("null", "none"):
            continue
        if key in OPTIONAL_GROUPS:
            return f"{override}: a config group takes an option's name; to leave {key} out, write ~{key}"
        names = sorted(path.stem for path in (conf_dir() / key).glob("*.yaml"))
        return f"{override}: the config group {key} is required; name one of its options ({', '.join(names)})"
    return None


def validate_top_level(cfg: DictConfig) -> None:
    """A key Hydra appended (`+train_steps=5`, `+experiment=x` without such a group) would be silently ignored."""
    known = config_groups()
    removed = [group for group in known if group not in OPTIONAL_GROUPS and group not in cfg]
    require(
        not removed,
        f"the config group(s) {', '.join(removed)} were removed (~{removed[0] if removed else ''}), but every run "
        f"needs them; only {', '.join(OPTIONAL_GROUPS)} may be left out",
    )
    unknown = [key for key in cfg if key not in known]
    require(
        not unknown,
        f"unknown top-level config key(s) {', '.join(map(str, unknown))} (a +key=value or a +group=option Hydra "
        f"did not find as a config group; known: {', '.join(known)})",
    )


def type_model_node(cfg: DictConfig) -> bool:
    """A model preset that extends no schema (a family of its own, forge.models.spec) names its arguments class in
    `_target_`: the node is typed by that class, so its keys, types and domains are checked like a schema's.
    Returns whether it typed the node (validate hands it back untyped: the class made here does not pickle)."""
    node = cfg.get("model")
    if not isinstance(node, DictConfig) or dataclasses.is_dataclass(OmegaConf.get_type(node)):
        return False
    target = node.get("_target_")
    require(isinstance(target, str), "model._target_ must name the model's arguments class")
    try:
        cls = get_class(target)
    except Exception as err:  # noqa: BLE001 - hydra wraps the import's own error
        raise ConfigError(f"model._target_={target}: cannot import it ({str(err).splitlines()[0]})") from None
    require(dataclasses.is_dataclass(cls), f"model._target_={target} is not an arguments dataclass")
    schema = dataclasses.make_dataclass(
        f"{cls.__name__}Config", [("_target_", str, dataclasses.field(default=target))], bases=(cls,)
    )
    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as err:
        raise ConfigError(f"model.{err.full_key or ''}: {str(err).splitlines()[0]}") from None
    cfg.model = typed
    return True


def validate_known_keys(node: DictConfig, prefix: str) -> None:
    """Keys a schema does not declare (`+train.stpes=5`: Hydra's `+` adds a key even to a typed group) are
    refused, in every node whose type is a schema dataclass."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    declared = {f.name for f in dataclasses.fields(schema)}
    unknown = [key for key in node if key not in declared]
    require(not unknown, f"unknown config key(s) {', '.join(f'{prefix}{key}' for key in unknown)}")
    for key in declared:
        child = node._get_node(key) if key in node else None
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            validate_known_keys(child, f"{prefix}{key}.")


def validate_model(cfg: DictConfig, degrees: Degrees) -> None:
    """The model family's own rules (its spec's check), after the parallel dimensions it does not support."""
    spec = spec_of(cfg.model)
    for dim in PARALLEL_DIMS:
        degree = getattr(degrees, dim)
        require(
            degree == 1 or dim in spec.parallel,
            f"parallel.{dim}={degree} is not supported by the {spec.name} model family (model._target_="
            f"{cfg.model._target_}; it runs {', '.join(['fsdp/hsdp/ddp', *sorted(spec.parallel)])})",
        )
    spec.check(cfg, degrees)


def validate_train(cfg: DictConfig, degrees: Degrees) -> None:
    train = cfg.train
    if train.device == "cuda":
        require(cuda_available(), "train.device=cuda but no CUDA device is available")
    require(
        train.seq_len <= cfg.model.max_seq_len,
        f"train.seq_len={train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}",
    )
    warmup = cfg.scheduler.get("warmup_steps", 0)
    require(warmup <= train.steps, f"scheduler.warmup_steps={warmup} is longer than train.steps={train.steps}")
    require(
        cfg.model.vocab_size >= cfg.data.vocab_size,
        f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's data.vocab_size="
        f"{cfg.data.vocab_size}",
    )


UNSUPPORTED = (
    # (name, applies to (cfg, degrees), why and what to use instead); docs/status.md lists every name
    ("tp+moe+compile", lambda c, d: d.tp > 1 and c.model.get("moe") is not None and c.parallel.compile,
     "torch.compile fails on the tensor-parallel MoE layer's DTensor hooks in torch 2.13; use parallel.compile=false"),
)  # fmt: skip
"""Combinations that fail later (in the plan or the first step) if not refused here."""


def unsupported_keys(name: str, cfg: DictConfig, degrees: Degrees) -> str:
    """The keys and values of a combination, as the user set them."""
    values = {
        "tp": f"parallel.tp={degrees.tp}",
        "pp": f"parallel.pp={degrees.pp}",
        "qk_norm": "model.qk_norm=true",
        "moe": "an MoE model (model.moe is set)",
        "fp8": "parallel.fp8=true",
        "document_masking": "data.document_masking=true",
        "mla": "model.attention_kind=mla",
        "compile": "parallel.compile=true",
    }
    return " with ".join(values[part] for part in name.split("+"))


def validate_combinations(cfg: DictConfig, degrees: Degrees) -> None:
    for name, applies, why in UNSUPPORTED:
        require(not applies(cfg, degrees), f"{unsupported_keys(name, cfg, degrees)} is not supported: {why}")


def validate_parallel(cfg: DictConfig, degrees: Degrees) -> None:
    parallel, model = cfg.parallel, cfg.model
    moe = model.get("moe")
    if degrees.ep > 1:
        require(
            moe is not None,
            f"parallel.ep={degrees.ep} needs an MoE model (model.moe is null: the model is dense, it has no experts "
            "to split; use model=moe_tiny or another MoE preset, or parallel.ep=1)",
        )
        if degrees.ep_spans_tp:
            require(
                degrees.tp > 1 and degrees.ep % degrees.tp == 0,
                f"parallel.ep_spans_tp=true needs parallel.tp > 1 and parallel.ep a multiple of it (got parallel.tp="
                f"{degrees.tp}, parallel.ep={degrees.ep}; the ep ranks are ep / tp dp_shard ranks times the tp ranks)",
            )
        require(
            degrees.dp_shard % degrees.ep_data == 0,
            f"parallel.ep={degrees.ep} must divide parallel.dp_shard={degrees.dp_shard} (expert parallelism borrows "
            f"ranks from the data-parallel shard dimension; data-parallel world size {degrees.dp})"
            if not degrees.ep_spans_tp
            else f"parallel.ep={degrees.ep} / parallel.tp={degrees.tp} must divide parallel.dp_shard="
            f"{degrees.dp_shard} (parallel.ep_spans_tp=true: ep borrows ep / tp dp_shard ranks)",
        )
        require(
            moe.num_experts % degrees.ep == 0,
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={degrees.ep}",
        )
    if degrees.pp > 1:
        require(cfg.get("vlm") is None, f"parallel.pp={degrees.pp} is not supported with a VLM (vlm is set)")
        stages = degrees.pp * stages_per_rank(parallel.pp_schedule)
        require(
            model.n_layers >= stages,
            f"model.n_layers={model.n_layers} cannot be split over the {stages} pipeline stages "
            f"(parallel.pp={degrees.pp}, parallel.pp_schedule={parallel.pp_schedule}): each needs a block",
        )
        schedule = str(parallel.pp_schedule)
        if schedule in ZERO_BUBBLE:
            require(
                degrees.dp_replicate * degrees.fsdp_shard == 1 or parallel.get("defer_grad_sync") is not False,
                f"parallel.pp_schedule={schedule} with parallel.defer_grad_sync=false under FSDP or DDP (dp_replicate "
                f"x dp_shard x cp = {degrees.dp_replicate * degrees.fsdp_shard}) is not supported: the schedule "
                "computes a chunk's weight gradients after its input gradients, so the stage's gradients are reduced "
                "once, when the step ends; leave parallel.defer_grad_sync unset",
            )
            # torch's zero-bubble schedules raise on compiled stage modules themselves. Forced past that (blocks
            # compiled in place, inductor's donated buffers off), pp2 zbv ran with a grad norm 1e-3 off one
            # process's at step 1 and 1.7 % off at step 4: a compiled block's backward is one graph, which the
            # split into input and weight gradients cannot divide.
            require(
                not parallel.compile,
                f"parallel.pp_schedule={schedule} with parallel.compile=true is not supported: torch's zero-bubble "
                "schedules refuse compiled stages (a compiled block's backward cannot be split into input and weight "
                "gradients); use parallel.compile=false, or parallel.pp_schedule=1f1b with compile",
            )
        require(
            not (schedule in V_SHAPED and model.get("tie_embeddings", False)),
            f"parallel.pp_schedule={schedule} with model.tie_embeddings=true is not supported: the first and the last "
            "stage share rank 0 in a V, as two copies of the tied matrix; use interleaved_zb or interleaved_1f1b",
        )
        micro = pipeline_chunks(degrees.pp, parallel.microbatches)
        local_batch = cfg.train.micro_batch_size
        require(
            local_batch % micro == 0,
            f"train.micro_batch_size={local_batch} is not divisible by parallel.microbatches={micro}",
        )
    if parallel.fp8 and cfg.train.device != "cpu" and cuda_available():  # a CPU run emulates float8 matmuls
        import torch

        require(
            torch.cuda.get_device_capability() >= (8, 9),
            f"parallel.fp8=true needs a GPU with float8 (compute capability >= 8.9), got "
            f"{torch.cuda.get_device_name()}",
        )


def validate_required(cfg: DictConfig, prefix: str = "") -> None:
    """Every mandatory (???) value is set: named all at once, before an interpolation trips over one of them.
    `prefix` names the node `cfg` is (e.g. "data." for a data config on its own)."""
    missing = sorted(_missing(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False), prefix))
    data = cfg if prefix == "data." else cfg.get("data")
    memmap = data is not None and composed_from(data, MemmapDataConfig)
    hints = {"data.path": "the folder forge-prepare-data wrote"} if memmap else {}
    hints["data.vocab_size"] = "the tokenizer's vocabulary size"
    require(
        not missing,
        "required config value(s) not set: "
        + ", ".join(f"{key} ({hints[key]})" if key in hints else key for key in missing),
    )


def _missing(node, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [key for name, value in node.items() for key in _missing(value, f"{prefix}{name}.")]
    return [prefix.rstrip(".")] if node == "???" else []


def validate_checkpoint(cfg: DictConfig) -> None:
    ckpt = cfg.checkpoint
    steps = cfg.train.steps
    outside = [m for m in ckpt.milestones if m > steps]
    require(
        not outside,
        f"checkpoint.milestones has {', '.join(map(str, outside))}, outside the run's steps 1..train.steps={steps} "
        "(no checkpoint would be saved there)",
    )
    if ckpt.get("save_hf"):
        validate_hf_export(cfg)


def validate_hf_export(cfg: DictConfig) -> None:
    """checkpoint.save_hf needs a model transformers can express: refused now, not after the run."""
    from forge.checkpoint.errors import CheckpointError
    from forge.checkpoint.hf import hf_adapter
    from forge.train.build import model_args

    require(cfg.get("vlm") is None, "checkpoint.save_hf=true exports text decoders only, not vision-language models")
    try:
        args = model_args(cfg)
        hf_adapter(args).args_to_config(args)
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.save_hf=true: {err}") from None


def validate_resilience(cfg: DictConfig, degrees: Degrees) -> None:
    res = cfg.resilience
    if res.nonfinite_policy == "rollback":
        require(
            cfg.checkpoint.interval > 0,
            "resilience.nonfinite_policy=rollback needs periodic checkpoints (checkpoint.interval > 0)",
        )
    require(
        res.straggler_factor == 0 or res.straggler_factor > 1,
        f"resilience.straggler_factor={res.straggler_factor} must be 0 (off) or > 1 (a factor over the median)",
    )
    if res.fault_tolerance == "torchft":
        validate_replica_groups(cfg, degrees)


def validate_replica_groups(cfg: DictConfig, degrees: Degrees) -> None:
    """resilience.fault_tolerance=torchft: the group is one of ft_replicas and torchft is installed (the groups'
    shares of the global batch are checked with the micro-batch, forge.config.resolve.fill_micro_batch)."""
    res = cfg.resilience
    prefix = "resilience.fault_tolerance=torchft"
    require(importlib.util.find_spec("torchft") is not None, f"{prefix} needs torchft: pip install 'forge-train[ft]'")
    require(
        res.ft_replica_id < res.ft_replicas,
        f"resilience.ft_replica_id={res.ft_replica_id} is not a group of resilience.ft_replicas={res.ft_replicas}",
    )
    require(
        res.ft_min_replicas <= res.ft_replicas,
        f"resilience.ft_min_replicas={res.ft_min_replicas} exceeds resilience.ft_replicas={res.ft_replicas}",
    )
    require(degrees.pp == 1, f"{prefix} with parallel.pp={degrees.pp} is not supported: pipeline stages are untested")
    require(
        res.nonfinite_policy != "rollback",
        f"{prefix} with resilience.nonfinite_policy=rollback is not supported: each group would reload its own "
        "checkpoint (use skip or raise)",
    )
    require(
        cfg.model.get("moe") is None,
        f"{prefix} with an MoE model is not supported: the routers' load balancing is per group",
    )


def validate_fault_injection(cfg: DictConfig, world_size: int) -> None:
    rank = cfg.resilience.inject_stall_rank
    require(
        rank is None or rank < world_size,
        f"resilience.inject_stall_rank={rank} is not a rank of the world size {world_size}",
    )


def validate_vlm(cfg: DictConfig, degrees: Degrees) -> None:
    """A VLM needs image/video data and vice versa; VLMs run data-parallel (FSDP) only, eager, on a grouped-query
    attention decoder; a pooling connector needs its token count. (Rules between the vlm group and the others:
    the VLM folder holds the strategies' arguments and plan, forge.models.vlm.)"""
    vlm = cfg.get("vlm")
    media_data = composed_from(cfg.data, VLMDataConfig)
    if vlm is None:
        require(
            not media_data,
            "an image/video data option needs a vision-language model: add vlm=joint_decoder "
            "(or cross_attention, mot, moma)",
        )
        return
    require(media_data, "vlm is set but the data has no images: use data=vqa_embedded, video_embedded or image_text")
    for name in PARALLEL_DIMS:
        value = getattr(degrees, name)
        require(value == 1, f"parallel.{name}={value} is not supported with a VLM (data parallelism and FSDP only)")
    for key in ("compile", "fp8"):
        require(not cfg.parallel[key], f"parallel.{key}=true is not supported with a VLM yet")
    require(
        cfg.model.get("attention_kind", "gqa") == "gqa",
        "model.attention_kind=mla is not supported with a VLM (its decoders build grouped-query attention)",
    )
    if vlm.connector in POOLING_CONNECTORS:
        require(vlm.connector_tokens is not None, f"vlm.connector={vlm.connector} needs vlm.connector_tokens >= 1")
    require(
        cfg.data.max_frames >= cfg.data.min_frames,
        f"data.max_frames={cfg.data.max_frames} >= data.min_frames={cfg.data.min_frames} >= 1 must hold",
    )


def validate_context_parallel(cfg: DictConfig, degrees: Degrees) -> None:
    """parallel.cp splits each sequence into 2 x cp chunks (forge.parallel.context_parallel) on the text path."""
    cp = degrees.cp
    if cp == 1:
        return
    seq = cfg.train.seq_len
    require(
        seq % (2 * cp) == 0,
        f"train.seq_len={seq} is not divisible by 2 x parallel.cp={cp} (each cp rank holds two equal chunks)",
    )
    refused = {
        "model.moe.capacity_factor > 0 (each cp rank would drop from its own part of the sequences)": (
            cfg.model.get("moe") is not None and cfg.model.moe.capacity_factor > 0
        ),
    }
    _refuse_each(
        refused,
        f"parallel.cp={cp} with {{what}} is not supported yet (context parallelism covers dense and MoE models, any "
        "dp, fsdp and tp; use parallel.cp=1)",
    )


def validate_loss(cfg: DictConfig, degrees: Degrees) -> None:
    """Pipeline stages compute plain cross-entropy (the schedule's loss); chunking also needs an unsplit head."""
    loss = cfg.get("loss")
    if loss is None:
        return
    chunked = "chunk_size" in loss
    if not chunked and not loss.get("z_loss_weight"):
        return
    what = "loss=chunked_cross_entropy" if chunked else f"loss.z_loss_weight={loss.z_loss_weight}"
    require(degrees.pp == 1, f"{what} is not supported with parallel.pp={degrees.pp} (the stages use plain CE)")
    if chunked:
        require(degrees.tp == 1, f"{what} is not supported with parallel.tp={degrees.tp} (the head is split)")


def validate_attention(cfg: DictConfig, degrees: Degrees) -> None:
    """model.attention and model.sliding_window (forge.models.common.attention), and the paths that cannot carry
    them."""
    model = cfg.model
    window = model.get("sliding_window")
    pattern = list(window) if OmegaConf.is_list(window) else [window]
    require(
        bool(pattern) and all(w is None or (type(w) is int and w >= 1) for w in pattern),
        f"model.sliding_window={window} must be null, a positive int, or a list of positive ints and nulls",
    )
    flex, windowed = model.get("attention") == "flex", any(w is not None for w in pattern)
    if flex:
        cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not cuda_available())
        require(
            not (cpu and cfg.parallel.compile),
            "model.attention=flex with parallel.compile=true is not supported on CPU: inductor's CPU flex kernel has "
            "no backward in torch 2.13; use parallel.compile=false",
        )
    require(
        cfg.get("vlm") is None or not (flex or windowed),
        "model.attention=flex and model.sliding_window are not supported with a VLM (its decoder builds dense masks "
        "of its own); use model.attention=sdpa and model.sliding_window=null",
    )
    require(
        not (windowed and cfg.checkpoint.get("save_hf")),
        "checkpoint.save_hf=true with model.sliding_window is not supported: the Hugging Face export has no window",
    )


def validate_compile_scope(cfg: DictConfig, degrees: Degrees) -> None:
    """parallel.compile_scope=model compiles the whole forward of one process's model (forge.parallel.plan
    .apply_compile): FSDP's per-block gathers, tensor-parallel DTensors and pipeline stages split it; the paths
    it has not run (fp8, flex attention) are refused."""
    parallel = cfg.parallel
    if parallel.compile_scope != "model":
        return
    require(
        parallel.compile,
        "parallel.compile_scope=model needs parallel.compile=true (the scope says what the compile covers)",
    )
    refused = {
        f"a world of {degrees.world_size} processes (one process only)": degrees.world_size > 1,
        "parallel.fp8=true": bool(parallel.fp8),
        # flex's own compiled kernel (dynamic=False) would be traced into the outer graph
        "model.attention=flex": cfg.model.get("attention") == "flex",
    }
    _refuse_each(
        refused, "parallel.compile_scope=model with {what} is not supported; use parallel.compile_scope=blocks"
    )


def validate_async_tp(cfg: DictConfig, degrees: Degrees) -> None:
    """parallel.async_tp: inductor's micro-pipelined tensor parallelism runs in compiled code on CUDA symmetric
    memory only."""
    parallel = cfg.parallel
    if not parallel.async_tp:
        return
    device = cfg.train.device
    refused = {
        f"parallel.tp={degrees.tp} (there is no tensor-parallel matmul to overlap; set parallel.tp > 1)": degrees.tp
        == 1,
        "parallel.compile=false (inductor does the splitting; set parallel.compile=true)": not parallel.compile,
        f"train.device={device} (symmetric memory needs CUDA GPUs; use parallel.async_tp=false on a CPU)": (
            device == "cpu" or not cuda_available()
        ),
    }
    _refuse_each(refused, "parallel.async_tp=true with {what} is not supported")


def validate_cuda_graphs(cfg: DictConfig, degrees: Degrees) -> None:
    """parallel.cuda_graphs replays the compiled blocks of a dense model in one GPU process (forge.parallel.plan
    .apply_compile); the paths it has not run are refused."""
    parallel = cfg.parallel
    if not parallel.cuda_graphs:
        return
    device = cfg.train.device
    on_cpu = device == "cpu" or (device == "auto" and not cuda_available())
    refused = {
        "parallel.compile=false (the graphs are the compiled code's; set parallel.compile=true)": not parallel.compile,
        f"a world of {degrees.world_size} processes (one GPU process only)": degrees.world_size > 1,
        f"parallel.activation_checkpoint={parallel.activation_checkpoint}": parallel.activation_checkpoint != "none",
        "parallel.fp8=true": bool(parallel.fp8),
        "an MoE model (its routing makes each step's shapes its own)": cfg.model.get("moe") is not None,
        "a VLM": cfg.get("vlm") is not None,
        f"train.device={device} (CUDA graphs need a GPU)": on_cpu,
    }
    _refuse_each(refused, "parallel.cuda_graphs=true with {what} is not supported")


def validate(cfg: DictConfig, world_size: int | None = None) -> Degrees:
    """Check the config's shape, resolve what it leaves to the run (forge.config.resolve: the micro batch, a prepared
    corpus's vocabulary; the only writes), then check every rule on the config made read-only; return the parallel
    degrees. Raises ConfigError naming the keys."""
    validate_top_level(cfg)
    typed = type_model_node(cfg)
    for group in cfg:
        if isinstance(cfg._get_node(group), DictConfig) and cfg[group] is not None:
            validate_known_keys(cfg[group], f"{group}.")
    validate_interpolations(cfg)
    if world_size is None:
        world_size = cfg.parallel.world_size or read_dist_env().world_size
    fill_vocab_from_data_meta(cfg.data)
    validate_required(cfg)
    validate_domains(cfg)  # each field's own range, before the rules between fields
    degrees = resolve_degrees(cfg.parallel, world_size)
    res = cfg.resilience
    fill_micro_batch(cfg.train, degrees.dp, res.ft_replicas if res.fault_tolerance == "torchft" else 1)
    with read_only(cfg):  # the rules read: a rule that wrote would fail here, not change the run
        check_rules(cfg, degrees)
    if typed:
        cfg.model = OmegaConf.create(OmegaConf.to_container(cfg.model))
    return degrees


def check_groups(node: DictConfig, prefix: str = "") -> None:
    """The rules within one group, declared by the group's schema (`check_group` beside its fields), in every typed
    node of the config: a group's own rules live with the fields they read; this module keeps the rules across
    groups."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            check_groups(child, f"{prefix}{key}.")
    check = getattr(OmegaConf.get_type(node), "check_group", None)
    if check is not None:
        check(node)


def check_rules(cfg: DictConfig, degrees: Degrees) -> None:
    """The rules between fields and across groups, on a resolved config."""
    check_groups(cfg)
    validate_model(cfg, degrees)
    validate_compile_scope(cfg, degrees)
    validate_cuda_graphs(cfg, degrees)  # before validate_train's device check: each refusal names its own key
    validate_async_tp(cfg, degrees)
    validate_train(cfg, degrees)
    validate_parallel(cfg, degrees)
    validate_context_parallel(cfg, degrees)
    validate_combinations(cfg, degrees)
    validate_checkpoint(cfg)
    validate_resilience(cfg, degrees)
    validate_fault_injection(cfg, degrees.world_size)
    validate_vlm(cfg, degrees)
    validate_loss(cfg, degrees)
    validate_attention(cfg, degrees)
