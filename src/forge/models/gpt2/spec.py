"""GPT-2's spec: what the generic machinery reads of the family (forge.models.spec), and its rules between the
model's fields and the other groups."""

from omegaconf import DictConfig, OmegaConf

from forge.config.degrees import Degrees
from forge.config.errors import require
from forge.domain import out_of_domain
from forge.models.gpt2.args import GPT2Args
from forge.models.gpt2.cost import GPT2Cost
from forge.models.gpt2.hf import GPT2HF
from forge.models.gpt2.model import GPT2
from forge.models.gpt2.parallelize import apply_tensor_parallel
from forge.models.spec import ModelSpec


def plain_args(model: DictConfig) -> GPT2Args:
    """The model's arguments as the dataclass the model is built from; a key it does not take, or a value outside
    its field's domain, is refused (a conf/model preset of this family is not typed by a schema)."""
    fields = {k: v for k, v in OmegaConf.to_container(model, resolve=True).items() if not k.startswith("_")}
    unknown = sorted(set(fields) - set(GPT2Args.__dataclass_fields__))
    require(not unknown, f"unknown config key(s) {', '.join(f'model.{key}' for key in unknown)} (a GPT-2 model)")
    args = GPT2Args(**fields)
    fault = out_of_domain(args, "model.")
    require(fault is None, f"{fault}")
    return args


def check(cfg: DictConfig, degrees: Degrees) -> None:
    """Every rule of the family, raising ConfigError naming the keys (the parallel dimensions it lacks, pp and ep,
    are refused by `SPEC.parallel`)."""
    args = plain_args(cfg.model)
    dim, heads, hidden, tp = args.dim, args.n_heads, args.hidden_dim, degrees.tp
    require(dim % heads == 0, f"model.dim={dim} is not divisible by model.n_heads={heads}")
    require(
        heads % tp == 0,
        f"model.n_heads={heads} must be divisible by parallel.tp={tp}: each tp rank holds an equal share of the heads",
    )
    require(
        hidden % tp == 0,
        f"the MLP's hidden width {hidden} (model.ffn_dim, or 4 x model.dim) is not divisible by parallel.tp={tp}: "
        "each tp rank holds an equal part of it",
    )
    require(
        not cfg.parallel.get("fp8", False),
        "parallel.fp8=true is not supported with a GPT-2 model (float8 converts nn.Linear layers; GPT-2's Conv1D "
        "projections are not); use parallel.fp8=false",
    )


SPEC = ModelSpec(
    name="gpt2",
    args=GPT2Args,
    build=GPT2,
    check=check,
    tensor_parallel=apply_tensor_parallel,
    cost=GPT2Cost(),
    hf=GPT2HF(),
    parallel=frozenset({"tp", "cp"}),
    generate=True,
)
