"""A fuzz test that walks the schemas: every field of every config group (and of the nodes inside them: model.moe,
data.sources.<name>, the trackers' options, forge-prepare-data's config) is composed with values outside its domain
(negative, zero, nan, inf, huge, empty, null, the wrong type) and at its edges. Each must be refused in one line
naming the key, or be accepted inside the field's declared domain; a seeded sample of the accepted values trains one
step. Composition and validation only for the rest (each context is composed once by Hydra; each case applies its
override as Hydra's compose does, to a copy).
"""

import contextlib
import copy
import dataclasses
import enum
import json
import math
import os
import random
import subprocess
import typing
from dataclasses import dataclass

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf

from forge.config import ConfigError, compose, conf_dir, register_schemas, validate
from forge.config.errors import composition_message
from tests.conftest import ROOT, forge_cmd, one_line
from tests.tiny import TINY_MODEL

SEED = int(os.environ.get("FORGE_FUZZ_SEED", "0"))
"""Which accepted values train (FORGE_FUZZ_SEED=n draws another sample)."""
TRAINED = 10
"""Accepted values trained one step each."""
HUGE = 2**40
BEYOND_INT64 = 2**64


def declared(field: dataclasses.Field):
    """The field's Domain, read from the dataclass field itself (forge.domain keeps it in the metadata)."""
    return field.metadata.get("domain")


def unwrap(hint):
    """(the type inside Optional[...], whether None is allowed)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return args[0], True
    return hint, False


def kind(hint) -> str:
    base, _ = unwrap(hint)
    origin = typing.get_origin(base) or base
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return "enum"
    if dataclasses.is_dataclass(origin):
        return "node"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(origin, "any")


NEEDS_NO_DOMAIN = {"bool", "enum", "node"}
"""Kinds whose type is the whole domain (two values, an Enum's members, a schema node checked field by field)."""

VALUES = {
    "int": ["-1", "0", "1", str(HUGE), str(BEYOND_INT64), "1.5", "abc", "null"],
    "float": ["-1", "0", "1e-12", "1", "nan", "inf", "-inf", "1e300", "abc", "null"],
    "str": ["", "' '", "x", "null"],
    "list": ["[]", "['']", "[-1]", "[nan]", "null"],
    "dict": ["{}", "null", "5"],
    "bool": ["maybe", "null"],
    "enum": ["bogus", "null"],
    "node": ["null", "5"],
    "any": ["null", "-1", "[]", "abc"],
}
"""What each kind of field is fuzzed with: outside most domains, at their common edges, of the wrong type."""


def edges(domain, kind_: str) -> list[str]:
    """Values at and just beyond a numeric domain's bounds."""
    if domain is None or kind_ not in ("int", "float"):
        return []
    step = 1 if kind_ == "int" else 1e-6
    values = []
    for bound, inside in ((domain.ge, 0), (domain.gt, step), (domain.le, 0), (domain.lt, -step)):
        if bound is not None:
            values += [bound + inside, bound - step if bound in (domain.ge, domain.gt) else bound + step]
    return [repr(int(v)) if kind_ == "int" else repr(float(v)) for v in values]


@dataclass
class Field:
    key: str
    kind: str
    optional: bool
    domain: object
    context: str


@dataclass
class Context:
    name: str
    overrides: list[str]
    config_name: str = "train"


def contexts(folder) -> list[Context]:
    """Compositions that, between them, hold every schema node: the default, then each group's other options."""
    memmap, sources = folder / "memmap", [folder / "web", folder / "books"]
    for path in (memmap, *sources):
        path.mkdir(parents=True, exist_ok=True)
        (path / "meta.json").write_text(json.dumps({"vocab_size": 8192}))
    (folder / "images").mkdir(exist_ok=True)
    vlm = ["model.max_seq_len=256"]
    return [
        Context("default", []),
        Context("moe", ["model=moe_tiny"]),
        Context("rope_scaling", ["model=llama3_1b"]),
        Context("lion", ["optimizer=lion"]),
        Context("muon", ["optimizer=muon"]),
        Context("schedule_free", ["optimizer=schedule_free_adamw", "scheduler=constant"]),
        Context("chunked", ["loss=chunked_cross_entropy"]),
        Context("wsd", ["scheduler=wsd"]),
        Context("memmap", ["data=memmap", f"data.path={memmap}"]),
        Context("hf", ["data=hf", f"data.dataset={folder / 'x.jsonl'}", "data.vocab_size=50257"]),
        Context(
            "mixture",
            ["data=mixture", "data.vocab_size=8192", f"data.sources.web.path={sources[0]}"]
            + [f"data.sources.books.path={sources[1]}"],
        ),
        Context("vqa_moma", ["data=vqa_embedded", "vlm=moma", *vlm]),
        Context("video_cross", ["data=video_embedded", "vlm=cross_attention", *vlm]),
        Context("photos", ["data=photos_embedded", "vlm=mot", *vlm]),
        Context("image_text", ["data=image_text", f"data.path={folder / 'images'}", "vlm=joint_decoder", *vlm]),
        Context("search", ["search=default"]),
        Context("prepare", [f"out_dir={folder / 'prepared'}"], config_name="prepare"),
    ]


def walk(node: DictConfig, prefix: str, context: str, found: dict[str, Field]) -> None:
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            key = f"{prefix}{f.name}"
            if key not in found:
                base_kind = kind(hints[f.name])
                found[key] = Field(key, base_kind, unwrap(hints[f.name])[1], declared(f), context)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            walk(child, f"{prefix}{key}.", context, found)
        elif isinstance(child, ListConfig) and not child._is_none() and not child._is_missing():
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    walk(item, f"{prefix}{key}[{i}].", context, found)


def check(cfg: DictConfig, config_name: str) -> None:
    """What forge-train (or forge-prepare-data) checks of a composed config."""
    if config_name == "prepare":
        from forge.data.cli import validate_prepare

        validate_prepare(cfg)
    else:
        validate(cfg, world_size=1)


def outcome(base: DictConfig, config_name: str, override: str) -> tuple[str, DictConfig | None]:
    """("refused", message) or ("accepted", cfg) of one override applied to the composed `base`, as Hydra does."""
    cfg = copy.deepcopy(base)
    try:
        parsed = OverridesParser.create().parse_overrides([override])
        ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
    except HydraException as err:
        return "refused", composition_message(err)
    try:
        check(cfg, config_name)
    except ConfigError as err:
        return "refused", str(err)
    return "accepted", cfg


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """Every field, every value: {(key, value): (outcome, message or composed config)}, and the fields."""
    folder = tmp_path_factory.mktemp("fuzz")
    register_schemas()
    fields: dict[str, Field] = {}
    bases: dict[str, tuple[DictConfig, str]] = {}
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for ctx in contexts(folder):
            cfg = hydra_compose(config_name=ctx.config_name, overrides=ctx.overrides)
            check(copy.deepcopy(cfg), ctx.config_name)  # each context itself is valid: its cases test one field
            bases[ctx.name] = (cfg, ctx.config_name)
            walk(cfg, "", ctx.name, fields)
    results = {}
    for f in fields.values():
        if f.key.endswith(("_target_", "_partial_")) or f.key.startswith("hydra."):
            continue
        base, config_name = bases[f.context]
        for value in dict.fromkeys(VALUES[f.kind] + edges(f.domain, f.kind)):
            results[f.key, value] = outcome(base, config_name, f"{f.key}={value}")
    return fields, results


def test_every_field_declares_its_domain(fuzzed):
    fields, results = fuzzed
    missing = sorted(f.key for f in fields.values() if f.kind not in NEEDS_NO_DOMAIN and f.domain is None)
    assert not missing, f"{len(missing)} fields declare no domain: {', '.join(missing)}"
    print(f"\n{len(fields)} fields, {len(results)} values tried")


def test_each_value_is_refused_in_one_line_naming_its_key_or_accepted_inside_its_domain(fuzzed):
    fields, results = fuzzed
    bad = []
    for (key, value), (result, detail) in results.items():
        f = fields[key]
        if result == "refused":
            if "\n" in detail or not detail.strip():
                bad.append(f"{key}={value}: refused over several lines: {detail!r}")
            continue
        composed = OmegaConf.select(detail, key)
        if isinstance(composed, DictConfig | ListConfig):
            composed = OmegaConf.to_container(composed, resolve=True)
        if composed is None and not f.optional and f.kind not in ("any", "node"):
            bad.append(f"{key}={value}: null accepted by a field that is not Optional")
        elif f.domain is not None and f.domain.reason(composed) is not None:
            bad.append(f"{key}={value}: accepted as {composed!r}, outside its domain ({f.domain.describe()})")
        elif isinstance(composed, float) and not math.isfinite(composed):
            bad.append(f"{key}={value}: accepted a non-finite number")
    refused = sum(r == "refused" for r, _ in results.values())
    print(f"\n{len(results)} values: {refused} refused, {len(results) - refused} accepted")
    assert not bad, f"{len(bad)} of {len(results)}:\n" + "\n".join(bad[:60])


def test_out_of_domain_refusals_name_the_key(fuzzed):
    fields, results = fuzzed
    unnamed = [
        f"{key}={value}: {detail}"
        for (key, value), (result, detail) in results.items()
        if result == "refused" and key.rsplit(".", 1)[-1].split("[")[0] not in detail
        and value in VALUES[fields[key].kind][:3] + ["nan", "inf", "", "null"]
    ]  # fmt: skip
    assert not unnamed, "\n".join(unnamed[:40])


EXTREMES = ("-1", "0", "1e-12", "nan", "inf", "-inf", "", "' '", "null", "[]", "['']", "[-1]", "{}")
"""Accepted values of these (zeros, negatives, empties, nulls) make up half of the trained sample."""
TRAIN_SMALL = [*TINY_MODEL, "train.steps=1", "train.seq_len=32", "train.global_batch_size=2", "train.eval_batches=1"]
TRAIN_SMALL += ["scheduler.warmup_steps=0", "train.eval_every=0"]


def trainable(key: str, value: str, context: str) -> bool:
    """Accepted values a one-step run can take in seconds: text-model contexts, no huge sizes or step counts."""
    if context not in ("default", "moe", "lion", "muon", "schedule_free", "chunked", "wsd"):
        return False
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    return abs(number) < 1e6 and not key.startswith(("resilience.inject", "metrics.profile", "checkpoint.load"))


def test_a_sample_of_accepted_values_trains_one_step(fuzzed, tmp_path):
    from forge.train.trainer import Trainer

    fields, results = fuzzed
    pool = sorted(
        (key, value)
        for (key, value), (result, _) in results.items()
        if result == "accepted" and trainable(key, value, fields[key].context)
    )
    rng = random.Random(SEED)
    extreme = [case for case in pool if case[1] in EXTREMES]  # half the sample from the values most likely to break
    sample = rng.sample(extreme, min(TRAINED // 2, len(extreme)))
    rest = [case for case in pool if case not in sample]
    sample += rng.sample(rest, min(TRAINED - len(sample), len(rest)))
    failed, refused, by_name = [], [], {c.name: c for c in contexts(tmp_path)}
    for i, (key, value) in enumerate(sample):
        overrides = [*by_name[fields[key].context].overrides, *TRAIN_SMALL, f"{key}={value}"]
        try:
            summary = Trainer(compose(overrides), tmp_path / f"run{i}").fit()
        except ConfigError as err:  # refused beside the small run's settings (one line): not trained
            refused.append(f"{key}={value}: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - any other failure is what this test finds
            failed.append(f"{key}={value}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        if not math.isfinite(summary["final_loss"]):
            failed.append(f"{key}={value}: trained to a loss of {summary['final_loss']}")
    print(f"\ntrained {len(sample) - len(refused)} of {len(pool)} accepted values: {sample}; refused: {refused}")
    assert not failed, "\n".join(failed)
    assert len(refused) <= len(sample) // 5, refused  # the sample trains: few meet a rule of the small run


ISSUE_EXAMPLES = [
    "train.grad_clip=-1", "train.grad_clip=nan", "scheduler.total_steps=0", "checkpoint.dir=", "metrics.smoothing=2",
    "metrics.peak_tflops=-1", "metrics.profile_start_step=5 metrics.profile_end_step=2",
    "resilience.watchdog_factor=-1", "resilience.preemption_deadline_s=-1", "resilience.max_rollbacks=-1",
    "resilience.preemption_signals=[]", "model.rope_theta=-1", "model.rope_theta=0", "model.norm_eps=-1",
    "model.init_std=-1", "model.ffn_dim=-5", "model.ffn_dim=null model.multiple_of=0", "optimizer.lr=inf",
    "train.seed=-1",
]  # fmt: skip
"""Issue 54's examples refused by composition and validation (in this process; the CLI's own paths below)."""


@pytest.mark.parametrize("example", ISSUE_EXAMPLES)
def test_the_issues_examples_are_refused_naming_their_key(example):
    overrides = example.split()
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=1)
    assert "\n" not in str(err.value)
    assert overrides[-1].split("=")[0] in str(err.value) or overrides[0].split("=")[0] in str(err.value)


EDGES = {  # overrides -> a fragment of the refusal, or None where the value is accepted
    "optimizer=muon optimizer.adamw_params=${checkpoint.load_weights_exclude}": None,  # a list from another key
    "metrics.trackers=${checkpoint.load_weights_exclude}": None,
    "checkpoint.milestones=${oc.create:[0]}": "checkpoint.milestones=[0] (from ${oc.create:[0]}) has 0",
    "train.steps=${oc.decode:'0'}": "train.steps=0 (from",  # a resolver names the key that holds it
    "model.ffn_dim=null model.ffn_dim_multiplier=1e308": "gives no feed-forward width",
    "model.ffn_dim=null model.ffn_dim_multiplier=1e-9": "makes the feed-forward width 0",
    "~optimizer": "the config group(s) optimizer were removed",
}
"""Values that once ended in a traceback or blamed another key (a review of the domain checks)."""


@pytest.mark.parametrize("example", list(EDGES))
def test_interpolated_and_derived_values_are_refused_in_one_line_or_accepted(example):
    fragment = EDGES[example]
    if fragment is None:
        validate(compose(example.split()), world_size=1)
        return
    with pytest.raises(ConfigError) as err:
        validate(compose(example.split()), world_size=1)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def cli_refusals(tmp_path) -> dict[str, list[str]]:
    """The CLI's own paths: Hydra's defaults list (a group set to null), sizes, the run directory."""
    afile = tmp_path / "afile"
    afile.write_text("")
    unwritable = "/sys/forge-run" if os.geteuid() == 0 else str(tmp_path / "readonly" / "run")
    return {
        "train=null": ["train=null"],
        "model.dim=1000000000000": ["model.dim=1000000000000"],
        "model.dim=65536 model.n_layers=64": ["model.dim=65536", "model.n_layers=64"],
        "hydra.run.dir=<a file>": [f"hydra.run.dir={afile}"],
        "hydra.run.dir=<under a file>": [f"hydra.run.dir={afile}/run"],
        "hydra.run.dir=<unwritable>": [f"hydra.run.dir={unwritable}"],
        "train.seed=-1 (CLI)": ["train.seed=-1"],
        "train.global_batch_size=2**30": [f"train.global_batch_size={2**30}"],
    }


def test_the_cli_refuses_in_one_line(tmp_path):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    cases = cli_refusals(tmp_path)
    procs = {
        name: subprocess.Popen(
            forge_cmd(*args, "train.steps=1", *([] if "hydra.run.dir" in args[0] else [f"hydra.run.dir={tmp_path}/r"])),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, args in cases.items()
    }  # fmt: skip
    lines = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        lines[name] = one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert "the config group train is required" in lines["train=null"]
    assert "more than a tensor's byte count can hold" in lines["model.dim=1000000000000"]
    assert "the run needs at least" in lines["model.dim=65536 model.n_layers=64"]
    assert "parameters" in lines["model.dim=65536 model.n_layers=64"]
    assert "GiB" in lines["model.dim=65536 model.n_layers=64"]
    assert "is a file, not a folder" in lines["hydra.run.dir=<a file>"]
    assert "Not a directory" in lines["hydra.run.dir=<under a file>"]
    assert "cannot be written" in lines["hydra.run.dir=<unwritable>"]
    assert "train.seed=-1 must be >= 0" in lines["train.seed=-1 (CLI)"]
    assert "each block's input kept for the backward" in lines["train.global_batch_size=2**30"]


def test_a_full_disk_at_start_is_one_line_naming_the_run_directory(tmp_path):
    """A 16 KiB tmpfs, filled: the run directory exists but nothing can be written (skipped where mounting is not
    allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (disk / "run").mkdir()
        with contextlib.suppress(OSError), open(disk / "fill", "wb") as fill:
            fill.write(b"\0" * 65536)
        proc = subprocess.run(
            forge_cmd("train.steps=1", f"hydra.run.dir={disk / 'run'}"), cwd=ROOT, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        line = one_line(proc)
        assert f"hydra.run.dir={disk / 'run'}" in line and "No space left on device" in line
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
