"""MoE models and latent attention under tensor parallelism (forge.models.llama.expert_tensor, latent_tensor), and MoE
models under context parallelism (their balancing counts summed over the cp ranks), train like one process: the
product's own example, `torchrun --nproc_per_node=4 -m forge.train model=moe parallel=tp4_fsdp`; tp2 / tp2 x fsdp2
with the router kinds, aux-loss scopes, shared experts, capacity limits, activation checkpointing and
deepseek_v3_small's latent attention (with and without the query's low-rank pair, and with ep2); ep spanning the tp
ranks (parallel.ep_spans_tp: whole experts over tp x dp_shard ranks); cp2 / cp2 x fsdp2 with each aux-loss scope,
cp2 x ep2 (and under HSDP); ep2 with selective checkpointing; on real gloo ranks.

The reference runs the same micro-batches in one process: a micro_batch aux loss is each micro-batch's, so a layout
with 2 data-parallel ranks of 4 samples is compared with one process accumulating 2 micro-batches of 4. The same
holds for the presets' balanced selection, solved on the tokens a layer routes: tp (which gathers the sequence
before routing), ep and dp cases keep it on. Cases whose ranks route other token sets than the reference's
micro-batches turn it off (SIGN): cp ranks each route half of every sequence, and the global_batch cases compare
2 ranks' micro-batches of 4 with one micro-batch of 8.
"""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, forge_cmd
from tests.parallel.harness import launch
from tests.parallel.scenarios import run_scenarios

pytestmark = pytest.mark.dist

RTOL = 1e-4  # fp32; the measured differences are ~1e-7 (the order of the tp ranks' partial sums)
MOE = ["model=moe_tiny", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4"]
MOE += ["model.moe.expert_ffn_dim=64"]
SIGN = ["model.moe.balanced_selection=false"]
SIGMOID = ["model.moe.router=sigmoid_topk", "model.moe.num_shared_experts=1", "model.moe.aux_loss_scope=global_batch"]
SIGMOID += SIGN
SEQUENCE = ["model.moe.aux_loss_scope=sequence", "model.moe.capacity_factor=1.0"]
LATENT = [  # deepseek_v3_small's kinds (latent attention, sigmoid router, a shared expert, sequence aux loss), small
    "model=deepseek_v3_small", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4",
    "model.vocab_size=${data.vocab_size}", "model.max_seq_len=256", "model.ffn_dim=128", "model.moe.num_experts=8",
    "model.moe.top_k=2", "model.moe.expert_ffn_dim=32", "model.moe.grouped_mm=false", "model.mla.q_lora_rank=32",
    "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8",
    "model.mla.v_head_dim=16",
]  # fmt: skip

# name -> (model settings, layout on the ranks, the one-process reference's micro-batch)
TWO_RANKS = {
    "tp2": ([], ["parallel=tp2", "train.micro_batch_size=8"], 8),
    "tp2_sequence_capacity_ac_full": (
        SEQUENCE, ["parallel=tp2", "train.micro_batch_size=8", "parallel.activation_checkpoint=full"], 8
    ),
    "tp2_accum_ac_selective": (
        [], ["parallel=tp2", "train.micro_batch_size=4", "parallel.activation_checkpoint=selective"], 4
    ),
    "latent_tp2": (LATENT, ["parallel=tp2", "train.micro_batch_size=8"], 8),
    "cp2": (SIGN, ["parallel=cp2", "train.micro_batch_size=8"], 8),
    # ep spanning the tp ranks: whole experts, each tp rank sends half of every expert's rows
    "tp2_ep2_spans_tp": (
        [], ["parallel=tp2", "parallel.ep=2", "parallel.ep_spans_tp=true", "train.micro_batch_size=8"], 8
    ),
    # the experts' FSDP hooks run inside the checkpointed block (forge.parallel.plan.selective_contexts)
    "ep2_ac_selective": (
        [], ["parallel=ep2_fsdp", "train.micro_batch_size=4", "parallel.activation_checkpoint=selective"], 4
    ),
}  # fmt: skip
FOUR_RANKS = {
    "tp4_fsdp": ([], ["parallel=tp4_fsdp", "train.micro_batch_size=8"], 8),
    "tp2_fsdp": ([], ["parallel=tp2_fsdp", "train.micro_batch_size=4"], 4),
    "tp2_fsdp_sigmoid_shared_global": (SIGMOID, ["parallel=tp2_fsdp", "train.micro_batch_size=4"], 8),
    "cp2_fsdp": (SIGN, ["parallel=cp2_fsdp", "train.micro_batch_size=4"], 4),
    "cp2_fsdp_sigmoid_global": (
        ["model.moe.router=sigmoid_topk", "model.moe.aux_loss_scope=global_batch", *SIGN],
        ["parallel=cp2_fsdp", "train.micro_batch_size=4"],
        8,
    ),
    "latent_cp2_fsdp": ([*LATENT, *SIGN], ["parallel=cp2_fsdp", "train.micro_batch_size=4"], 8),
    "latent_full_wq_tp2_fsdp": (
        [*LATENT, "model.mla.q_lora_rank=0", *SIGN],
        ["parallel=tp2_fsdp", "train.micro_batch_size=4"],
        8,
    ),
    # ep over the dp_shard ranks of one tp index: each expert's width split over tp, the experts over ep
    "tp2_ep2": ([], ["parallel=tp2_fsdp", "parallel.ep=2", "train.micro_batch_size=4"], 4),
    "tp2_ep2_sigmoid_shared_global": (SIGMOID, ["parallel=tp2_fsdp", "parallel.ep=2", "train.micro_batch_size=4"], 8),
    "tp2_fsdp_ep4_spans_tp": (
        [],
        ["parallel=tp2_fsdp", "parallel.ep=4", "parallel.ep_spans_tp=true", "train.micro_batch_size=4"],
        4,
    ),
    "latent_tp2_fsdp_ep2_spans_tp": (
        LATENT,
        ["parallel=tp2_fsdp", "parallel.ep=2", "parallel.ep_spans_tp=true", "train.micro_batch_size=4"],
        4,
    ),
    "latent_tp2_ep2": (LATENT, ["parallel=tp2_fsdp", "parallel.ep=2", "train.micro_batch_size=4"], 4),
    "tp2_cp2_ep2_spans_tp": (  # every rank a cp x tp index: the experts' FSDP group is the cp pair
        SIGN,
        ["parallel=cp2", "parallel.tp=2", "parallel.ep=2", "parallel.ep_spans_tp=true", "train.micro_batch_size=8"],
        8,
    ),
    "ep2_fsdp4_ac_selective": (  # the experts' own FSDP group has 2 ranks
        [],
        ["parallel=fsdp", "parallel.ep=2", "train.micro_batch_size=2", "parallel.activation_checkpoint=selective"],
        2,
    ),
    # ep over the dp_shard ranks of one cp index; the experts' FSDP group spans their cp peers (who route other
    # positions of the same sequences to them)
    "cp2_ep2": (SIGN, ["parallel=cp2_fsdp", "parallel.ep=2", "train.micro_batch_size=4"], 4),
}
EIGHT_RANKS = {
    "tp2_ep2_fsdp2": ([], ["parallel=tp2_fsdp", "parallel.ep=2", "train.micro_batch_size=2"], 2),
    "hsdp_cp2_ep2": (
        SIGN,
        ["parallel=cp2_fsdp", "parallel.dp_replicate=2", "parallel.ep=2", "train.micro_batch_size=2"],
        2,
    ),
}
"""The experts' weights FSDP-sharded too: over dp_shard / ep = 2 as 2-D (ep, tp) DTensors, and over (dp_replicate,
(dp_shard / ep) x cp) as HSDP."""


def references(cases: dict) -> dict[str, list[str]]:
    return {f"ref_{name}": [*base(model), "parallel=single", f"train.micro_batch_size={micro}"]
            for name, (model, _, micro) in cases.items()}  # fmt: skip


def layouts(cases: dict) -> dict[str, list[str]]:
    return {name: [*base(model), *layout] for name, (model, layout, _) in cases.items()}


def base(model: list[str]) -> list[str]:
    """A case's model: the small MoE with its settings, or a latent-attention model of its own."""
    return model if model[:1] == LATENT[:1] else [*MOE, *model]


@pytest.fixture(scope="module")
def reference_curves(tmp_path_factory):
    cases = TWO_RANKS | FOUR_RANKS | EIGHT_RANKS
    return launch(run_scenarios, 1, references(cases), str(tmp_path_factory.mktemp("single")))[0]


@pytest.fixture(scope="module")
def two_rank_curves(tmp_path_factory):
    return launch(run_scenarios, 2, layouts(TWO_RANKS), str(tmp_path_factory.mktemp("two")))[0]


@pytest.fixture(scope="module")
def four_rank_curves(tmp_path_factory):
    return launch(run_scenarios, 4, layouts(FOUR_RANKS), str(tmp_path_factory.mktemp("four")))[0]


def assert_same_curves(got: dict, want: dict) -> None:
    assert len(got["loss"]) == len(want["loss"]) == 4
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=RTOL), key


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_rank_moe_layouts_match_one_process(name, two_rank_curves, reference_curves):
    run = two_rank_curves[name]
    assert run["wq_placements"] == ["S(0)"]  # a parallel plan was applied (tp's rows, or FSDP's over dp x cp)
    if "ep2" in name:
        assert run["local_params"] < 0.6 * run["params"]  # the experts are split, not copied
    assert_same_curves(run, reference_curves[f"ref_{name}"])


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_rank_moe_layouts_match_one_process(name, four_rank_curves, reference_curves):
    run = four_rank_curves[name]
    assert run["wq_placements"] in (["S(0)"], ["_S(0, 2)", "S(0)"])
    assert run["local_params"] < 0.6 * run["params"]  # the experts are split, not copied
    assert_same_curves(run, reference_curves[f"ref_{name}"])


def test_tensor_and_expert_parallel_experts_under_fsdp_match_one_process(reference_curves, tmp_path):
    runs = launch(run_scenarios, 8, layouts(EIGHT_RANKS), str(tmp_path))[0]
    for name in EIGHT_RANKS:
        assert runs[name]["local_params"] < 0.3 * runs[name]["params"], name
        assert_same_curves(runs[name], reference_curves[f"ref_{name}"])


def losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
def test_the_products_example_runs_on_four_ranks_like_one_process(tmp_path):
    """The command as a user types it (steps shortened, fp32 so one process is an exact reference), against the
    same config in one process."""
    short = ["train.steps=3", "train.log_every=1", "train.eval_batches=1", "train.dtype=fp32", "train.threads=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", "forge.train",
           "model=moe", "parallel=tp4_fsdp", *short, f"hydra.run.dir={tmp_path / 'tp4'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 MoE layers: experts' hidden widths split" in (tmp_path / "tp4" / "forge.log").read_text()
    one = forge_cmd("model=moe", "parallel=single", *short, f"hydra.run.dir={tmp_path / 'one'}")
    proc = subprocess.run(one, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert losses(tmp_path / "tp4") == pytest.approx(losses(tmp_path / "one"), rel=RTOL)


@pytest.mark.slow
def test_a_tensor_parallel_moe_checkpoint_resumes_in_one_process_and_under_expert_parallelism(tmp_path):
    """The product's example layout, tp4_fsdp: its DCP checkpoint (experts split on their hidden width over 4 ranks)
    read into the whole experts of one process and into ep2 x fsdp's expert shards on 2: steps 3 and 4 continue the
    tp4 run's curve."""
    common = ["model=moe", "train.steps=4", "train.dtype=fp32", "train.log_every=1", "train.eval_batches=1",
              "train.threads=1"]  # fmt: skip

    def torchrun(nproc: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]

    saved = tmp_path / "tp4"
    resume = f"checkpoint.resume={saved}/checkpoints/step-00000002"
    runs = {
        "tp4": [*torchrun(4), "-m", "forge.train", *common, "parallel=tp4_fsdp", "checkpoint.interval=2",
                f"hydra.run.dir={saved}"],
        "one": forge_cmd(*common, "parallel=single", resume),
        "ep2_fsdp": [*torchrun(2), "-m", "forge.train", *common, "parallel=ep2_fsdp", resume],
    }  # fmt: skip
    curves = {}
    for name, cmd in runs.items():
        run_dir = tmp_path / name
        if name != "tp4":
            cmd = [*cmd, f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        curves[name] = losses(run_dir)
    assert "tensor parallel over 4 ranks" in (saved / "forge.log").read_text()
    assert len(curves["tp4"]) == 4 and len(curves["one"]) == len(curves["ep2_fsdp"]) == 2
    assert curves["one"] == pytest.approx(curves["tp4"][2:], rel=RTOL)
    assert curves["ep2_fsdp"] == pytest.approx(curves["tp4"][2:], rel=1e-3)  # its own micro-batches' aux losses
