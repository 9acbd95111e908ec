"""The table `forge-train --plan --search` prints, and the winner as overrides for the next command."""

import copy
import math

from omegaconf import DictConfig

from forge.config import ConfigError, validate
from forge.planning.memory import uses_dense_masks
from forge.planning.search.cost import ModelShape, Prediction, predict
from forge.planning.search.devices import DEVICES, GIB, Device, device_from_profile
from forge.planning.search.layouts import layouts
from forge.planning.search.settings import SearchSettings


def settings_of(cfg: DictConfig) -> SearchSettings:
    """The search options of cfg, checked: one ConfigError naming the first key out of its range."""
    node = cfg.search
    settings = SearchSettings(**{key: node[key] for key in node if not str(key).startswith("_")})
    if settings.device not in DEVICES and settings.profile is None:
        raise ConfigError(f"search.device={settings.device!r} is not one of {', '.join(DEVICES)}")
    ranges = {
        "compute_efficiency": 0 < settings.compute_efficiency <= 1,
        "comm_efficiency": 0 < settings.comm_efficiency <= 1,
        "memory_headroom": 0 <= settings.memory_headroom < 1,
        "gpus_per_node": settings.gpus_per_node >= 1,
        "max_micro_batch_size": settings.max_micro_batch_size >= 1,
        "top": settings.top >= 1,
        "memory_gib": settings.memory_gib is None or settings.memory_gib > 0,
        "intra_node_gbps": settings.intra_node_gbps is None or settings.intra_node_gbps > 0,
        "inter_node_gbps": settings.inter_node_gbps is None or settings.inter_node_gbps > 0,
    }
    for key, ok in ranges.items():
        if not ok:
            bounds = "in (0, 1]" if "efficiency" in key else "in [0, 1)" if key == "memory_headroom" else "> 0"
            raise ConfigError(f"search.{key}={getattr(settings, key)} must be {bounds}")
    return settings


def device_of(settings: SearchSettings) -> Device:
    """The calibrated profile when search.profile is set, else the table's device."""
    if settings.profile is None:
        return DEVICES[settings.device]
    try:
        return device_from_profile(settings.profile)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def search(cfg: DictConfig) -> tuple[list[Prediction], int, list[str]]:
    """Every candidate layout that fits in memory, fastest first; how many were considered; notes."""
    from forge.train import build

    settings = settings_of(cfg)
    device = device_of(settings)
    world = cfg.parallel.world_size or 1
    notes = []
    train = cfg.train
    if train.global_batch_size % world:
        fitted = math.ceil(train.global_batch_size / world) * world
        notes.append(f"note: train.global_batch_size={train.global_batch_size} raised to {fitted} for the search "
                     "(a multiple of the world size: every data-parallel degree divides it)")  # fmt: skip
        train.global_batch_size = fitted
    memory = (settings.memory_gib or device.memory_gib) * GIB * (1 - settings.memory_headroom)
    shape = ModelShape.of(build.build_meta_model(cfg))
    dtype = "fp32" if train.dtype == "fp32" else "bf16"
    dense_masks = uses_dense_masks(cfg)
    considered, fitting = 0, []
    for layout in layouts(shape.args, world, train.global_batch_size, settings.gpus_per_node,
                          settings.max_micro_batch_size, train.seq_len):  # fmt: skip
        considered += 1
        prediction = predict(layout, shape, train, device, settings, dtype, dense_masks)
        if prediction.memory <= memory:
            fitting.append(prediction)
    fitting.sort(key=lambda p: (p.step, p.memory, p.layout.pp_schedule == "gpipe"))  # ties: 1F1B holds less
    return fitting, considered, notes


def valid(cfg: DictConfig, prediction: Prediction) -> str | None:
    """None when validation accepts the layout on cfg, else its message."""
    candidate = copy.deepcopy(cfg)
    layout = prediction.layout
    for key, value in zip(("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp"), layout.degrees_tuple()):
        candidate.parallel[key] = value
    candidate.parallel.activation_checkpoint = layout.activation_checkpoint
    if layout.pp > 1:
        candidate.parallel.pp_schedule, candidate.parallel.microbatches = layout.pp_schedule, layout.microbatches
    candidate.train.micro_batch_size = layout.micro_batch_size
    try:
        validate(candidate, cfg.parallel.world_size or 1)
    except ConfigError as err:
        return str(err)
    return None


def search_report(cfg: DictConfig) -> str:
    settings = settings_of(cfg)
    device = device_of(settings)
    fitting, considered, notes = search(cfg)
    world = cfg.parallel.world_size or 1
    memory = settings.memory_gib or device.memory_gib
    where = settings.device if settings.profile is None else f"{device.name} (profile {settings.profile})"
    lines = [f"search: {considered} layouts of {world} ranks considered, {len(fitting)} fit in "
             f"{memory:.1f} GiB x {1 - settings.memory_headroom:.2f} per {where}", *notes]  # fmt: skip
    refusals: dict[int, str | None] = {}  # validation of a layout, once: it copies and checks the whole config

    def refusal_of(prediction: Prediction) -> str | None:
        if id(prediction) not in refusals:
            refusals[id(prediction)] = valid(cfg, prediction)
        return refusals[id(prediction)]

    shown: list[Prediction] = []
    refused, first_refusal = 0, ""
    for prediction in fitting:
        if len(shown) == settings.top:
            break
        refusal = refusal_of(prediction)
        if refusal is None:
            shown.append(prediction)
        else:
            first_refusal = first_refusal or refusal
            refused += 1
    if not shown and refused:
        lines.append(f"no layout: the {refused} that fit are all refused by validation, e.g. {first_refusal}")
        return "\n".join(lines)
    if not shown:
        lines.append("no layout fits: a larger world, a shorter sequence, a smaller model or more device memory")
        return "\n".join(lines)
    if refused:
        lines.append(f"({refused} faster layouts skipped: validation refuses them)")
    peak = device.peak_flops("fp32" if cfg.train.dtype == "fp32" else "bf16")
    header = f"{'#':>2}  {'layout':<58} {'GiB/rank':>8} {'step s':>8} {'tok/s':>10} {'MFU':>6}  dominant"
    lines += [header]
    for i, p in enumerate(shown, 1):
        mfu = p.flops / p.step / world / peak
        lines.append(f"{i:>2}  {p.layout.short():<58} {p.memory / GIB:>8.1f} {p.step:>8.3f} "
                     f"{p.tokens / p.step:>10,.0f} {mfu:>6.1%}  {p.dominant}")  # fmt: skip
    winner = shown[0]
    lines.append("winner: " + " ".join(winner.layout.overrides()))
    runner_up = next((p for p in fitting if p.layout.degrees != winner.layout.degrees and refusal_of(p) is None), None)
    if runner_up is not None:
        lines.append(why_slower(runner_up, winner))
    lines.append("cost model: forge.planning.search.cost (predicted, not measured)")
    return "\n".join(lines)


def why_slower(runner_up: Prediction, winner: Prediction) -> str:
    """The fastest layout of other degrees than the winner's, and the terms that cost it the most over it."""
    gaps = {term: runner_up.seconds[term] - winner.seconds[term] for term in winner.seconds}
    worst = sorted((term for term in gaps if gaps[term] > 0), key=gaps.get, reverse=True)[:2]
    terms = ", ".join(f"{t} {runner_up.seconds[t]:.3f} s against {winner.seconds[t]:.3f} s" for t in worst)
    pct = runner_up.step / winner.step - 1
    return f"runner-up (other degrees): {runner_up.layout.short()}, {pct:.1%} slower: {terms}"
