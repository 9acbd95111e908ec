"""Each option's default is written once, and each closed list of choices is listed once.

A config group's schema (config/schema.py) declares its options with their defaults and docstrings; the `_target_`
it builds takes them as parameters without defaults. Two copies drift (they did: `cache_dir`), so a parameter with
a default in both fails here. A list of choices that config/validate.py checks is the one the implementing code
declares, imported, not a second literal; a choice of a field is an Enum (refused at composition), not listed in
validate.py at all.
"""

import ast
import dataclasses
import enum
import inspect
import re
import typing
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, OmegaConf

from forge.config import ConfigError, compose
from forge.config.paths import conf_dir
from forge.config.schema import SCHEMAS

SRC = Path(__file__).resolve().parents[2] / "src" / "forge"


def schema_of(raw: dict) -> type | None:
    for entry in raw.get("defaults") or []:
        if isinstance(entry, str) and entry.endswith("@_here_") and entry.lstrip("/").split("@")[0] in SCHEMAS:
            return SCHEMAS[entry.lstrip("/").split("@")[0]]
    return None


def schema_targets() -> dict[tuple[type, str], Path]:
    """(schema, _target_) for every conf/ option that builds a forge object, and every schema's own target."""
    pairs: dict[tuple[type, str], Path] = {}
    for path in sorted(conf_dir().rglob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        schema = schema_of(raw)
        if schema is None:
            continue
        target = raw.get("_target_", getattr(schema, "_target_", MISSING))
        if target != MISSING and target.startswith("forge."):
            pairs.setdefault((schema, target), path)
    for schema in SCHEMAS.values():
        target = getattr(schema, "_target_", MISSING)
        if target != MISSING and target.startswith("forge."):
            pairs.setdefault((schema, target), Path("src/forge/config/schema.py"))
    return pairs


def has_default(f: dataclasses.Field) -> bool:
    return (
        f.default is not dataclasses.MISSING and f.default != MISSING
    ) or f.default_factory is not dataclasses.MISSING


def declared_by(cls: type, name: str) -> type:
    """The class of cls's MRO whose body declares the field `name` (ModelConfig's dim: TransformerArgs)."""
    return next(klass for klass in cls.__mro__ if name in vars(klass).get("__annotations__", {}))


def test_the_walk_finds_the_targets():
    targets = {target for _, target in schema_targets()}
    for expected in (
        "forge.data.embedded.EmbeddedCorpus",
        "forge.models.vlm.JointDecoderVLM",
        "forge.train.losses.CrossEntropyLoss",
    ):
        assert expected in targets


def test_no_default_is_written_in_a_schema_and_again_in_its_target():
    twice = []
    for (schema, target), where in schema_targets().items():
        built = get_object(target)
        if not (built.__init__ if isinstance(built, type) else built).__module__.startswith("forge."):
            continue  # a package's class (schedulefree's AdamW under a forge subclass): its defaults are not ours
        parameters = inspect.signature(built).parameters
        for f in dataclasses.fields(schema):
            if isinstance(built, type) and declared_by(schema, f.name) in built.__mro__:
                continue  # the schema extends the dataclass that declares it for the target too: one declaration
            parameter = parameters.get(f.name)
            declared_here = not f.name.startswith("_") and has_default(f)
            if declared_here and parameter is not None and parameter.default is not inspect.Parameter.empty:
                twice.append(f"{target}({f.name}=...) and {schema.__name__}.{f.name} ({where})")
    assert not twice, "defaults written twice:\n" + "\n".join(twice)


def string_collections(tree: ast.AST) -> list[tuple[int, frozenset[str]]]:
    """Every literal tuple, list or set of two or more strings in a module, and every dict with such keys."""
    found = []
    for node in ast.walk(tree):
        elements = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict) or not elements or len(elements) < 2:
            continue
        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elements):
            found.append((node.lineno, frozenset(e.value for e in elements)))  # type: ignore[union-attr]
    return found


def test_validation_lists_no_choice_the_code_declares():
    validate = SRC / "config" / "validate.py"
    checked = string_collections(ast.parse(validate.read_text()))
    elsewhere: dict[frozenset[str], str] = {}
    for path in sorted(SRC.rglob("*.py")):
        if path != validate:
            for lineno, choices in string_collections(ast.parse(path.read_text())):
                elsewhere.setdefault(choices, f"{path.relative_to(SRC.parent)}:{lineno}")
    repeated = [
        f"config/validate.py:{lineno} lists {sorted(choices)}, declared in {elsewhere[choices]}"
        for lineno, choices in checked
        if choices in elsewhere
    ]
    assert not repeated, "\n".join(repeated)


def enum_of(annotation) -> type[enum.Enum] | None:
    """The Enum of a field annotated `E` or `Optional[E]`."""
    for kind in (annotation, *typing.get_args(annotation)):
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return kind
    return None


def enum_fields(node: DictConfig, prefix: str = "") -> dict[str, type[enum.Enum]]:
    """`key: Enum` for every Enum field of every schema node under `node` (a composed config)."""
    found: dict[str, type[enum.Enum]] = {}
    schema = OmegaConf.get_type(node)
    hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
    for key in node:
        choices = enum_of(hints.get(str(key)))
        if choices is not None:
            found[f"{prefix}{key}"] = choices
        child = node._get_node(key)  # not the value: an unset (None) sub-config is skipped, interpolations unread
        if isinstance(child, DictConfig) and not child._is_none():
            found.update(enum_fields(child, f"{prefix}{key}."))
    return found


# Compositions that, together, hold every config group with an Enum field (an MoE model, a VLM and its data).
COMPOSITIONS = ([], ["model=moe_tiny"], ["vlm=joint_decoder", "data=vqa_embedded"])
CHOICE_FIELDS = {key: kind for overrides in COMPOSITIONS for key, kind in enum_fields(compose(list(overrides))).items()}
COMPOSED_WITH = {
    key: list(overrides) for overrides in reversed(COMPOSITIONS) for key in enum_fields(compose(list(overrides)))
}


def test_closed_choices_are_enum_fields():
    for key in (
        "parallel.activation_checkpoint",
        "parallel.pp_schedule",
        "train.dtype",
        "checkpoint.async_mode",
        "model.attention",
        "model.moe.router",
        "vlm.connector",
        "data.on_bad_media",
    ):
        assert key in CHOICE_FIELDS, sorted(CHOICE_FIELDS)


@pytest.mark.parametrize("key", sorted(CHOICE_FIELDS))
def test_a_choice_an_enum_does_not_have_is_refused_at_composition(key):
    choices = ", ".join(member.name for member in CHOICE_FIELDS[key])
    with pytest.raises(ConfigError, match=re.escape(f"{key}='bogus' is not one of {choices}")):
        compose([*COMPOSED_WITH[key], f"{key}=bogus"])


def test_validation_lists_no_choice_an_enum_field_declares():
    """validate.py keeps only rules across fields: an Enum's values (or most of them) or its class are not there."""
    source = (SRC / "config" / "validate.py").read_text()
    tree = ast.parse(source)
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    listed = string_collections(tree)
    repeated = []
    for key, kind in CHOICE_FIELDS.items():
        values = {member.value for member in kind}
        repeated += [f"{key}: validate.py uses {kind.__name__}" for _ in [1] if kind.__name__ in names]
        repeated += [f"{key}: validate.py:{line} lists {sorted(c)}" for line, c in listed if len(c & values) >= 2]
        repeated += [f"{key}: validate.py checks it with _one_of" for _ in [1] if f'_one_of("{key}"' in source]
    assert not repeated, "\n".join(repeated)
