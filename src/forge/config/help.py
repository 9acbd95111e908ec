"""Field documentation from the schemas' attribute docstrings: one line per field for `forge-train --help` (the value
this command would run, the field's domain, the first sentence), the whole text for docs/reference/config.md.

    python -m forge.config.help            # rewrite docs/reference/config.md
    python -m forge.config.help --check    # exit 1 when docs/reference/config.md is stale (tests/config/test_help.py)
"""

import ast
import dataclasses
import enum
import inspect
import re
import sys
import textwrap
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from forge.config import schema
from forge.domain import domain_of

_GROUP_SCHEMAS = {
    "model": schema.ModelConfig,
    "parallel": schema.ParallelConfig,
    "data": schema.EmbeddedDataConfig,
    "optimizer": schema.OptimizerConfig,
    "loss": schema.CrossEntropyLossConfig,
    "scheduler": schema.DecayScheduleConfig,
    "train": schema.TrainConfig,
    "checkpoint": schema.CheckpointConfig,
    "metrics": schema.MetricsConfig,
    "metrics.tracker_configs.tensorboard": schema.TensorBoardTrackerConfig,
    "metrics.tracker_configs.wandb": schema.WandbTrackerConfig,
    "metrics.tracker_configs.mlflow": schema.MlflowTrackerConfig,
    "resilience": schema.ResilienceConfig,
    "search": schema.SearchConfig,
}
"""The schema of each group's default option: what --help documents when the composed config does not say."""

VALUE_WIDTH = 40
"""A value longer than this is shortened in --help (the docs and `--cfg job` print it whole)."""


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and its bases: {field: doc}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def field_domains(cls: type) -> dict[str, str]:
    """The declared domain of each field of a dataclass, in words ({field: "> 0"}; fields without one left out)."""
    domains = {f.name: domain_of(f) for f in dataclasses.fields(cls)}
    return {name: domain.describe() for name, domain in domains.items() if domain is not None and domain.describe()}


SUMMARY_WIDTH = 160
"""A field's --help description: its first sentence, cut at a clause boundary past this many characters."""


CELL_WIDTH = 240
"""A docstring longer than this shows its summary in the reference page's table and its whole text below it."""


def summary(doc: str) -> str:
    """The docstring's first sentence (a decimal point or `e.g.` ends none), cut at its last `;`, `:` or `,`
    within SUMMARY_WIDTH characters when longer, so that a field's line stays within about two terminal lines."""
    match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\d)\.\s", doc + " ")
    sentence = doc[: match.start() + 1] if match else doc
    if len(sentence) <= SUMMARY_WIDTH:
        return sentence
    cut = max(sentence.rfind(mark, 0, SUMMARY_WIDTH) for mark in ("; ", ": ", ", "))
    return (sentence[:cut] if cut > SUMMARY_WIDTH // 3 else sentence[:SUMMARY_WIDTH]) + " ..."


def shown(value, width: int | None = VALUE_WIDTH) -> str:
    """A value as YAML writes it, on one line; shortened past `width` characters (None: whole)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, enum.Enum):
        value = value.name
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    if isinstance(value, list):
        text = "[" + ", ".join(shown(item, None) for item in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{key}: {shown(item, None)}" for key, item in value.items()) + "}"
    return text if width is None or len(text) <= width else text[: width - 3] + "..."


def schema_of(node, fallback: type) -> type:
    """The dataclass a composed group node was typed by, or the class its `_target_` names (a family of its own),
    else `fallback`."""
    if isinstance(node, DictConfig):
        kind = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(kind):
            return kind
        target = node.get("_target_")
        if isinstance(target, str):
            from hydra.utils import get_class

            try:
                cls = get_class(target)
            except Exception:  # noqa: BLE001 - a help page documents what it can
                return fallback
            if dataclasses.is_dataclass(cls):
                return cls
    return fallback


def field_help(*, _root_: DictConfig | None = None) -> str:
    """One line per documented field, grouped by config group: `train.steps = 250 [domain]: first sentence.`; the
    value is the one this command composes (`_root_`, the config Hydra renders the help of), domains and docs are
    the schemas'."""
    lines = []
    for group, fallback in _GROUP_SCHEMAS.items():
        node = OmegaConf.select(_root_, group, default=None) if _root_ is not None else None
        cls = schema_of(node, fallback)
        values = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else {}
        declared = {f.name: f for f in dataclasses.fields(cls)}
        domains = field_domains(cls)
        for name, doc in field_docs(cls).items():
            value = values[name] if name in values else _declared_default(declared.get(name))
            value_text = "" if value is dataclasses.MISSING else f" = {shown(value)}"
            domain = f" [{domains[name]}]" if name in domains else ""
            lines.append(f"  {group}.{name}{value_text}{domain}: {summary(doc)}")
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the help template with string.Template: $$ prints $


def _declared_default(field: dataclasses.Field | None):
    if field is None:
        return dataclasses.MISSING
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def reference_page() -> str:
    """docs/reference/config.md: every schema (each group's options and nested nodes), each field with its
    default, domain and whole docstring."""
    lines = [
        "# Config reference",
        "",
        "Generated from the schemas' field docstrings by `python -m forge.config.help` (forge/config/schema.py and the",
        "arguments classes of the model families and the VLMs); `tests/config/test_help.py` fails when this page is",
        "stale. `forge-train --help` prints one line per field with the value the command would run; `forge-train",
        "--cfg job` prints the whole composed config.",
        "",
    ]
    for name, cls in documented_classes().items():
        docs = field_docs(cls)
        if not docs:
            continue
        domains = field_domains(cls)
        declared = {f.name: f for f in dataclasses.fields(cls)}
        lines += [f"## {name}", "", " ".join((cls.__doc__ or "").split()), ""]
        lines += ["| field | default | domain | meaning |", "|---|---|---|---|"]
        longer = []
        for field, doc in docs.items():
            default = _declared_default(declared.get(field))
            whole = shown(default, None).replace("|", "/")
            default_text = "required" if default is dataclasses.MISSING or default == "???" else f"`{whole}`"
            domain = domains.get(field, "")
            meaning = doc if len(doc) <= CELL_WIDTH else summary(doc) + " (below)"
            lines.append(f"| `{field}` | {default_text} | {domain} | {meaning.replace('|', '/')} |")
            if len(doc) > CELL_WIDTH:
                longer.append(f"- `{field}`: {doc}")
        lines += ["", *longer, ""] if longer else [""]
    return "\n".join(lines)


def documented_classes() -> dict[str, type]:
    """Every schema, every model family's arguments class, and the dataclasses their fields nest (MoE, latent
    attention, rope scaling, ...), by name, in that order."""
    import typing

    from forge.models.spec import families

    found: dict[str, type] = {}

    def visit(cls: type) -> None:
        if cls.__name__ in found:
            return
        found[cls.__name__] = cls
        for hint in typing.get_type_hints(cls).values():
            for inner in (hint, *typing.get_args(hint)):
                if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                    visit(inner)

    for cls in schema.SCHEMAS.values():
        visit(cls)
    for spec in families():  # a family's arguments class a schema extends (ModelConfig: Llama's) is documented there
        if not any(issubclass(cls, spec.args) for cls in found.values()):
            visit(spec.args)
    return found


def page_path() -> Path:
    return Path(__file__).resolve().parents[3] / "docs" / "reference" / "config.md"


def main() -> None:
    page = reference_page()
    if "--check" in sys.argv:
        sys.exit(0 if page_path().read_text() == page else 1)
    page_path().write_text(page)


if __name__ == "__main__":
    main()
