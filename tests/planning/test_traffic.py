"""The cost model's bytes per collective are what the real collectives of a training step move, on 4 gloo ranks.

A dispatch mode sees every c10d op of one optimizer step (after a first one): FSDP2's all-gathers and
reduce-scatters (over each group at its own size: experts shard over fewer ranks), context parallelism's key and
value all-gathers and their gradients' reduce-scatters (over the cp pairs), HSDP's all-reduce over the replicas,
DTensor's tensor-parallel collectives, the pipeline's sends and expert parallelism's all-to-alls.
Bytes a rank sends in a ring: (n - 1) / n of a gathered output or a reduce-scattered input, 2 (n - 1) / n of an
all-reduced buffer.
"""

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forge.config import compose
from forge.config.schema import V_SHAPED
from forge.planning.search.cost import Layout, ModelShape, predict
from forge.planning.search.devices import DEVICES
from forge.planning.search.settings import SearchSettings
from forge.train import build
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LAYOUTS = {  # preset -> the same layout as the search writes it
    "fsdp": Layout(1, 4, 1, 1, 1, "none", 1),
    "hsdp": Layout(2, 2, 1, 1, 1, "none", 1),
    "tp2_fsdp": Layout(1, 2, 2, 1, 1, "none", 1),
    "tp2_fsdp_moe": Layout(1, 2, 2, 1, 1, "none", 1),  # experts split on their width, the router's logits summed
    "pp2_fsdp": Layout(1, 2, 1, 2, 1, "none", 4, "1f1b", 4),  # one micro-batch of 4 chunks
    "ep2_fsdp": Layout(1, 4, 1, 1, 2, "none", 1),
    "pp2": Layout(2, 1, 1, 2, 1, "none", 2, "1f1b", 2),  # x DDP over 2: 2 micro-batches of 2 chunks
    "cp2_fsdp": Layout(1, 2, 1, 1, 1, "none", 1, cp=2),  # FSDP over dp_shard 2 x cp 2, K/V over the cp pairs
    "cp2_fsdp_selective": Layout(1, 2, 1, 1, 1, "selective", 1, cp=2),  # the recompute gathers K/V again
    "cp2_fsdp_moe": Layout(1, 2, 1, 1, 1, "none", 1, cp=2),  # the experts sharded over dp_shard x cp as the rest
    "cp2_ep2_moe": Layout(1, 2, 1, 1, 2, "none", 1, cp=2),  # the experts' FSDP group: (dp_shard / ep) x cp = 2
    "pp2_ep2_moe": Layout(1, 2, 1, 2, 2, "none", 4, "1f1b", 4),  # the last stage: its blocks' all-to-alls
    "tp2_ep2_moe": Layout(1, 2, 2, 1, 2, "none", 1),  # the all-to-all between the ranks of one tp index
    "tp2_pp2": Layout(1, 1, 2, 2, 1, "none", 8, "1f1b", 4),  # the last stage: tp with the head
    "pp2_fsdp_zbv": Layout(1, 2, 1, 2, 1, "none", 4, "zbv", 4),  # each stage gathered once, reduced once
}
MODEL = {
    "ep2_fsdp": ["model=moe_tiny"],
    "tp2_fsdp_moe": ["model=moe_tiny"],
    "cp2_fsdp_moe": ["model=moe_tiny"],
    "cp2_ep2_moe": ["model=moe_tiny", "parallel.ep=2"],
    "pp2_ep2_moe": ["model=moe_tiny", "parallel.ep=2"],
    "tp2_ep2_moe": ["model=moe_tiny", "parallel.ep=2"],
    "cp2_fsdp_selective": ["parallel.activation_checkpoint=selective"],
    "pp2_fsdp_zbv": ["parallel.pp_schedule=zbv", "model.n_layers=4"],
}
"""The MoE layout trains the default MoE (8 experts, top 2) at the tiny width; other extra overrides."""
PRESET = {"cp2_fsdp_selective": "cp2_fsdp", "tp2_fsdp_moe": "tp2_fsdp", "cp2_fsdp_moe": "cp2_fsdp"}
PRESET |= {"cp2_ep2_moe": "cp2_fsdp", "pp2_ep2_moe": "pp2_fsdp", "tp2_ep2_moe": "tp2_fsdp", "tp2_pp2": "pp2"}
PRESET |= {"pp2_fsdp_zbv": "pp2_fsdp"}
"""The parallel preset of a layout not named after one."""
MICRO = {
    "pp2_fsdp": [],
    "pp2_ep2_moe": [],
    "pp2_fsdp_zbv": [],
    "tp2_pp2": [
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.dp_shard=1",
        "parallel.microbatches=4",
        "train.micro_batch_size=8",
    ],
    "pp2": ["train.micro_batch_size=2", "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.microbatches=2"],
}
"""Micro-batch overrides: 1 sample (2 or 4 micro-batches per rank: the per-micro-batch traffic counts), except
under the pipelines (pp2_fsdp's 4 chunks need 4 samples; pp2 runs over 2 DDP replicas, 2 micro-batches each,
where the schedule reduces once per micro-batch)."""


class CollectiveBytes(TorchDispatchMode):
    """Bytes of the first tensor argument of every collective, by op, by the size of its group and whether the
    group is `cp_group` (the output of c10d's all-gather and reduce-scatter, the input of the functional ones). An
    all-to-all also counts the bytes it keeps on this rank (its own split), which it does not send."""

    def __init__(self, cp_group=None):
        super().__init__()
        self.cp_group = cp_group
        self.bytes: Counter = Counter()
        self.kept: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name and "wait_tensor" not in name and "wrap_tensor" not in name:
            first = args[0]
            tensors = [t for group in (first if isinstance(first, list | tuple) else [first])
                       for t in (group if isinstance(group, list | tuple) else [group])]  # fmt: skip
            nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            group = group_of(args)
            self.bytes[name, group.size(), group == self.cp_group] += nbytes
            if "all_to_all_single" in name:  # (input, output splits, input splits, group name)
                splits = args[2]
                self.kept[name] += nbytes * splits[group.rank()] / max(sum(splits), 1)
        return func(*args, **(kwargs or {}))


def group_of(args: tuple):
    """The process group of a collective's arguments: a c10d op's ProcessGroup, or a functional op's group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    names = [arg for arg in args if isinstance(arg, str)]  # a functional op's last string names its group
    if names:
        return _resolve_process_group(names[-1])
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith("ProcessGroup"):
            return torch.distributed.ProcessGroup.unbox(arg)
    raise AssertionError(f"no process group among {args}")


def micro(preset: str) -> list[str]:
    return MICRO.get(preset, ["train.micro_batch_size=1"])


def overrides(preset: str) -> list[str]:
    return [*TINY, f"parallel={PRESET.get(preset, preset)}", *micro(preset), *MODEL.get(preset, [])]


def count_one_step(root: str) -> dict[str, dict]:
    out = {}
    for preset in LAYOUTS:
        trainer = Trainer(compose(overrides(preset)), Path(root) / preset)
        trainer.train_step(1)
        names = trainer.mesh.mesh_dim_names
        with CollectiveBytes(trainer.mesh["cp"].get_group() if "cp" in names else None) as counted:
            trainer.train_step(2)
        out[preset] = {"bytes": dict(counted.bytes), "kept": dict(counted.kept)}
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """Every rank's counts: the cost model predicts a pipeline's busiest rank, the one holding the last stage."""
    return launch(count_one_step, 4, str(tmp_path_factory.mktemp("traffic")))


def total(counted: dict, op: str, weight, on_cp: bool = False) -> float:
    """Bytes of `op` over its groups (the cp group's, or the others'), each group's weighted by weight(its size)."""
    return sum(nbytes * weight(size) for (name, size, cp), nbytes in counted.items() if name == op and cp == on_cp)


def sent(counted: dict, layout: Layout) -> dict[str, float]:
    """Bytes this rank sent, by the cost model's names. The all-to-alls count as the cost model counts them, under
    uniform routing: (ep - 1) / ep of the tokens they carry (test_expert_tokens_cross_ranks_as_routing_sends checks
    the share the router really sent)."""
    out = {}
    gather, scatter = "c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"
    if layout.dp_shard * layout.cp > 1:  # FSDP's groups: dp_shard x cp, and the experts' own
        out["fsdp_all_gather"] = total(counted, gather, lambda n: (n - 1) / n)
        out["fsdp_reduce_scatter"] = total(counted, scatter, lambda n: n - 1)
    if layout.cp > 1:  # the keys and values, gathered forward, their gradients reduce-scattered backward
        out["cp"] = total(counted, gather, lambda n: (n - 1) / n, on_cp=True)
        out["cp"] += total(counted, scatter, lambda n: n - 1, on_cp=True)
    if layout.dp_replicate > 1:
        out["replicate_all_reduce"] = total(counted, "c10d.allreduce_.default", lambda n: 2 * (n - 1) / n)
    if layout.pp > 1:  # the last stage, which sends its activations' gradients back
        out["pp"] = total(counted, "c10d.send.default", lambda n: 1)
    if layout.tp > 1:
        out["tp"] = (
            total(counted, "_c10d_functional.all_gather_into_tensor.default", lambda n: n - 1)
            + total(counted, "_c10d_functional.reduce_scatter_tensor.default", lambda n: (n - 1) / n)
            + total(counted, "_c10d_functional.all_reduce.default", lambda n: 2 * (n - 1) / n)
            # an MoE router's logits gradient, summed over the tp group in the backward (c10d, outside DTensor)
            + total(counted, "c10d.allreduce_.default", lambda n: 2 * (n - 1) / n if n == layout.tp else 0)
        )
    if layout.ep > 1:
        out["ep"] = all_to_all_bytes(counted) * (layout.ep - 1) / layout.ep
    return out


def all_to_all_bytes(counted: dict) -> float:
    """Bytes the tokens' all-to-alls carried (dispatch and combine, forward and backward; not the counts')."""
    return sum(nbytes for (name, *_), nbytes in counted.items() if "all_to_all_single" in name)


@pytest.mark.parametrize("preset", list(LAYOUTS))
def test_predicted_bytes_are_the_counted_ones(preset, counted):
    layout = LAYOUTS[preset]
    cfg = compose(overrides(preset))
    shape = ModelShape.of(build.build_meta_model(cfg))
    predicted = predict(layout, shape, cfg.train, DEVICES["h100"], SearchSettings(), dtype="fp32").moved
    head_rank = -1 if layout.pp > 1 and layout.pp_schedule not in V_SHAPED else 0  # a V's last stage is on rank 0
    measured = sent(counted[head_rank][preset]["bytes"], layout)
    assert set(predicted) == set(measured)
    for kind, nbytes in measured.items():
        # padding to the shard count, a few scalar all-reduces: under 1 %. Under TP the cost model's three
        # all-reduces per token of the vocabulary-parallel cross-entropy are issued inside DTensor's dispatch,
        # where this mode does not see them (1,536 of 332,800 bytes in tp2_fsdp)
        assert predicted[kind] == pytest.approx(nbytes, rel=0.01), kind


def test_expert_tokens_cross_ranks_as_routing_sends(counted):
    """The all-to-alls send the tokens routed to the other rank's experts and keep the rest: at init the router
    is near uniform, so about (ep - 1) / ep of them leave (the share the cost model assumes)."""
    bytes_, kept = counted[0]["ep2_fsdp"]["bytes"], counted[0]["ep2_fsdp"]["kept"]
    carried = all_to_all_bytes(bytes_)
    assert carried > 0 and 0 < sum(kept.values()) < carried
    assert 0.3 < 1 - sum(kept.values()) / carried < 0.7
