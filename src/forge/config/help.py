"""Field documentation for `forge-train --help`, read from the schemas' attribute docstrings."""

import ast
import dataclasses
import inspect
import textwrap

from forge.config import schema
from forge.domain import domain_of

_GROUP_SCHEMAS = {
    "model": schema.ModelConfig,
    "parallel": schema.ParallelConfig,
    "data": schema.EmbeddedDataConfig,
    "optimizer": schema.OptimizerConfig,
    "scheduler": schema.WSDScheduleConfig,
    "train": schema.TrainConfig,
    "checkpoint": schema.CheckpointConfig,
    "metrics": schema.MetricsConfig,
    "metrics.tracker_configs.tensorboard": schema.TensorBoardTrackerConfig,
    "metrics.tracker_configs.wandb": schema.WandbTrackerConfig,
    "metrics.tracker_configs.mlflow": schema.MlflowTrackerConfig,
    "resilience": schema.ResilienceConfig,
    "search": schema.SearchConfig,
}


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


def field_help() -> str:
    """One line per documented field, grouped by config group, with its domain: `train.grad_clip [>= 0]: ...`."""
    lines = []
    for group, cls in _GROUP_SCHEMAS.items():
        domains = field_domains(cls)
        for name, doc in field_docs(cls).items():
            shown = f" [{domains[name]}]" if name in domains else ""
            lines.append(f"  {group}.{name}{shown}: {doc}")
    return "\n".join(lines)
