"""Every layout starts from the very weights one process initialises from the same seed (bit for bit), each rank
filling only its shards from the row blocks they overlap instead of from a whole reference model."""

import hashlib
from pathlib import Path

import pytest
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from forge.config import compose
from forge.parallel.init import plain_name
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY

pytestmark = pytest.mark.dist

MOE = ["model=moe_tiny", "model.moe.num_experts=4", "model.moe.expert_ffn_dim=32"]
LAYOUTS = {  # name -> (overrides, world size)
    "fsdp": (["parallel=fsdp"], 2),
    "tp2_fsdp": (["parallel=tp2_fsdp"], 4),
    # 69 MLP rows per tp rank: FSDP's shards of TP's shards are uneven (35 and 34 rows).
    "tp2_fsdp_uneven": (["parallel=tp2_fsdp", "model.ffn_dim=138"], 4),
    "pp2": (["parallel=pp2", "model.n_layers=4"], 2),
    "ep2_fsdp": (["parallel=ep2_fsdp", *MOE], 2),
    # one local expert over 2 FSDP ranks: the experts are sharded on their second dimension
    "ep2_fsdp_one_expert": (["parallel=ep2_fsdp", *MOE, "model.moe.num_experts=2"], 4),
}
REFERENCE = {
    "fsdp": [],
    "tp2_fsdp": [],
    "tp2_fsdp_uneven": ["model.ffn_dim=138"],
    "pp2": ["model.n_layers=4"],
    "ep2_fsdp": MOE,
    "ep2_fsdp_one_expert": [*MOE, "model.moe.num_experts=2"],
}


def digest(tensor) -> tuple:
    """Shape, dtype and a hash of the bytes: bitwise equality, small enough for the harness's result queue."""
    return tuple(tensor.shape), str(tensor.dtype), hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def initial_weights(overrides: list[str], root: str) -> dict:
    """This rank's model (its stages, under pp) as whole tensors by plain name, right after it was built."""
    trainer = Trainer(compose([*TINY, *overrides]), Path(root))
    parts = trainer.pipeline.parts if trainer.pipeline is not None else [trainer.model]
    out = {}
    for part in parts:
        state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        out |= {plain_name(k): digest(v) for k, v in state.items()}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_starts_from_the_one_process_weights(layout, tmp_path):
    overrides, world = LAYOUTS[layout]
    (reference,) = launch(initial_weights, 1, ["parallel=single", *REFERENCE[layout]], str(tmp_path / "one"))
    ranks = launch(initial_weights, world, overrides, str(tmp_path / layout))
    for rank, weights in enumerate(ranks):
        assert weights and set(weights) <= set(reference), (rank, sorted(set(weights) - set(reference)))
        for name, value in weights.items():
            assert value == reference[name], (layout, rank, name)
    assert set().union(*ranks) == set(reference)  # every weight is held somewhere
