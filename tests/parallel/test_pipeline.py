"""Pipeline-parallel layouts train like one process: same losses, grad norms and validation losses.

Each launch forks real gloo ranks running the real Trainer on several pipeline layouts in turn; the reference is
the same Trainer in one process with parallel=single (fp32).
"""

import re
from pathlib import Path

import pytest

from forge.config import compose
from forge.parallel.dist import is_main_process
from forge.parallel.plan import count_local_parameters
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import TINY, curves
from tests.parallel.test_context_parallel import document_data

RTOL = 1e-4  # fp32; pipelining only changes how the batch is chunked (micro-batch means of the loss)

pytestmark = pytest.mark.dist

FOUR_LAYERS = ["model.n_layers=4"]  # interleaved 1F1B on 2 ranks needs 4 stages of one block
REFERENCE = {
    "single": ["parallel=single", "train.micro_batch_size=8"],
    "single_4l": ["parallel=single", "train.micro_batch_size=8", *FOUR_LAYERS],
    "single_tied": ["parallel=single", "train.micro_batch_size=8", "model.tie_embeddings=true"],
    "single_3l": ["parallel=single", "train.micro_batch_size=8", "model.n_layers=3"],
    "single_6l": ["parallel=single", "train.micro_batch_size=8", "model.n_layers=6"],
}
TWO_RANKS = {
    "pp2_gpipe": ["parallel=pp2", "parallel.pp_schedule=gpipe", "train.micro_batch_size=8"],
    "pp2_1f1b": ["parallel=pp2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=8"],
    "pp2_1f1b_accum": ["parallel=pp2", "train.micro_batch_size=4", "parallel.microbatches=2"],
    "pp2_uneven": ["parallel=pp2", "train.micro_batch_size=8", "model.n_layers=3"],  # stages of 2 and 1 blocks
    "pp2_interleaved": [
        "parallel=pp2",
        "parallel.pp_schedule=interleaved_1f1b",
        "train.micro_batch_size=8",
        *FOUR_LAYERS,
    ],
    # zero-bubble: input and weight gradients apart, the weight ones filling the bubble (4 chunks: a steady state)
    **{
        f"pp2_{schedule}": [
            "parallel=pp2",
            f"parallel.pp_schedule={schedule}",
            "train.micro_batch_size=8",
            "parallel.microbatches=4",
            *FOUR_LAYERS,
        ]
        for schedule in ("interleaved_zb", "zbv", "dualpipev")
    },
    # a V over 6 blocks: 3 per rank (stages of 2, 2, 1, 1; rank 0 holds stages 0 and 3), not 2 and 4 stage-even
    "pp2_zbv_uneven": [
        "parallel=pp2",
        "parallel.pp_schedule=zbv",
        "train.micro_batch_size=8",
        "parallel.microbatches=4",
        "model.n_layers=6",
    ],
}
FOUR_RANKS = {
    "pp2_fsdp": ["parallel=pp2_fsdp", "train.micro_batch_size=4", "parallel.microbatches=2"],
    # zero-bubble under data and context parallelism: the stage stays gathered through the step, so torch's split
    # backward finds the weights the forward used, and is reduced once at its end
    "pp2_fsdp_zbv": ["parallel=pp2_fsdp", "parallel.pp_schedule=zbv", "train.micro_batch_size=4", *FOUR_LAYERS],
    "pp2_ddp_interleaved_zb": [
        "parallel.pp=2",
        "parallel.dp_replicate=2",
        "parallel.pp_schedule=interleaved_zb",
        "train.micro_batch_size=4",
        "parallel.microbatches=4",
        *FOUR_LAYERS,
    ],
    "cp2_pp2_dualpipev": [
        "parallel.pp=2",
        "parallel.cp=2",
        "parallel.pp_schedule=dualpipev",
        "train.micro_batch_size=8",
        "parallel.microbatches=4",
        *FOUR_LAYERS,
    ],
}
# Tensor-parallel stages: the residual stream crosses a stage boundary as a sequence-split DTensor, the last stage's
# logits are split over the vocabulary (the schedule runs under loss_parallel).
TP2_PP2 = ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1", "train.micro_batch_size=8"]
TP_STAGES = {
    "tp2_pp2_1f1b": TP2_PP2,
    "tp2_pp2_gpipe": [*TP2_PP2, "parallel.pp_schedule=gpipe"],
    "tp2_pp2_interleaved": [*TP2_PP2, "parallel.pp_schedule=interleaved_1f1b", *FOUR_LAYERS],
    "tp2_pp2_tied": [*TP2_PP2, "model.tie_embeddings=true"],
    "tp2_pp2_zbv": [*TP2_PP2, "parallel.pp_schedule=zbv", *FOUR_LAYERS],
    "tp2_pp2_interleaved_zb": [
        *TP2_PP2,
        "parallel.pp_schedule=interleaved_zb",
        "parallel.microbatches=4",
        *FOUR_LAYERS,
    ],
    "tp2_pp2_dualpipev": [*TP2_PP2, "parallel.pp_schedule=dualpipev", "parallel.microbatches=4", *FOUR_LAYERS],
}
REFERENCE_OF = {
    "pp2_uneven": "single_3l",
    "pp2_interleaved": "single_4l",
    "pp2_interleaved_zb": "single_4l",
    "pp2_zbv": "single_4l",
    "pp2_zbv_uneven": "single_6l",
    "pp2_dualpipev": "single_4l",
    "tp2_pp2_interleaved": "single_4l",
    "tp2_pp2_zbv": "single_4l",
    "tp2_pp2_interleaved_zb": "single_4l",
    "tp2_pp2_dualpipev": "single_4l",
    "tp2_pp2_tied": "single_tied",
    "pp2_fsdp_zbv": "single_4l",
    "pp2_ddp_interleaved_zb": "single_4l",
    "cp2_pp2_dualpipev": "single_4l",
}


def run_pipeline_scenarios(scenarios: dict[str, list[str]], root: str) -> dict[str, dict]:
    """Train each scenario on this rank; rank 0 returns its curves, every rank its stage's layout."""
    out = {}
    for name, overrides in scenarios.items():
        trainer = Trainer(compose([*TINY, *overrides]), Path(root) / name)
        layout = {
            "blocks": sorted(k for k, _ in trainer.model.named_modules() if k.count(".") == 1 and "layers." in k),
            "block_ids": sorted(  # over all of this rank's stages
                int(m.group(1)) for k, _ in trainer.model.named_modules() if (m := re.search(r"layers\.(\d+)$", k))
            ),
            "local_params": count_local_parameters(trainer.model),
            "params": trainer.n_params,
        }
        trainer.fit()  # ends with an evaluation
        if trainer.pipeline is not None:
            schedule = trainer.pipeline.schedule
            stages = getattr(schedule, "_stages", None) or [schedule._stage]
            layout["cached_chunks"] = sum(len(stage.fwd_cache) for stage in stages)
            layout["stages"] = [stage.stage_index for stage in stages]
        out[name] = layout | (curves(trainer.run_dir) if is_main_process() else {})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(run_pipeline_scenarios, 1, REFERENCE, str(tmp_path_factory.mktemp("single")))[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(run_pipeline_scenarios, 2, TWO_RANKS, str(tmp_path_factory.mktemp("pp2")))


def assert_same_curves(got: dict, want: dict) -> None:
    assert len(got["loss"]) == len(want["loss"]) == 4
    for key in ("loss", "grad_norm", "val_loss"):
        assert got[key] == pytest.approx(want[key], rel=RTOL), key


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_pp2_matches_one_process(layout, two_ranks, reference):
    assert_same_curves(two_ranks[0][layout], reference[REFERENCE_OF.get(layout, "single")])


def test_stages_hold_disjoint_blocks(two_ranks):
    assert two_ranks[0]["pp2_1f1b"]["blocks"] == ["layers.0"]
    assert two_ranks[1]["pp2_1f1b"]["blocks"] == ["layers.1"]
    assert [rank["pp2_uneven"]["blocks"] for rank in two_ranks] == [["layers.0", "layers.1"], ["layers.2"]]
    assert [rank["pp2_zbv_uneven"]["block_ids"] for rank in two_ranks] == [[0, 1, 5], [2, 3, 4]]
    # interleaved: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (ModuleList of two stage modules)
    assert (
        two_ranks[0]["pp2_interleaved"]["local_params"] + two_ranks[1]["pp2_interleaved"]["local_params"]
        == (two_ranks[0]["pp2_interleaved"]["params"])
    )
    for run in ("pp2_gpipe", "pp2_1f1b"):
        assert two_ranks[0][run]["local_params"] + two_ranks[1][run]["local_params"] == two_ranks[0][run]["params"]
    assert [rank["pp2_interleaved_zb"]["stages"] for rank in two_ranks] == [[0, 2], [1, 3]]  # looped
    for run in ("pp2_zbv", "pp2_dualpipev"):  # a V: the first and the last stage on rank 0
        assert [rank[run]["stages"] for rank in two_ranks] == [[0, 3], [1, 2]]


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_evaluation_leaves_no_chunk_cached(layout, two_ranks):
    """torch's stage caches each chunk's output and inputs for its backward; a forward-only pass (the closing
    evaluation) has none, and left the last stage holding every chunk's logits until the next step."""
    assert [rank[layout]["cached_chunks"] for rank in two_ranks] == [0, 0]


def test_pp2_with_data_or_context_parallelism_matches_one_process(tmp_path, reference):
    runs = launch(run_pipeline_scenarios, 4, FOUR_RANKS, str(tmp_path))
    for layout in FOUR_RANKS:
        assert_same_curves(runs[0][layout], reference[REFERENCE_OF.get(layout, "single")])
    assert sum(r["pp2_fsdp"]["local_params"] for r in runs) == runs[0]["pp2_fsdp"]["params"]


def test_tensor_parallel_stages_match_one_process(tmp_path, reference):
    """tp 2 inside each of 2 stages, 4 ranks: each schedule, and tied embeddings split over the vocabulary on the
    first and the last stage."""
    runs = launch(run_pipeline_scenarios, 4, TP_STAGES, str(tmp_path))
    for layout in TP_STAGES:
        assert_same_curves(runs[0][layout], reference[REFERENCE_OF.get(layout, "single")])
        assert [rank[layout]["cached_chunks"] for rank in runs] == [0] * 4


def test_tp2_pp2_fsdp_matches_one_process(tmp_path, reference):
    """The shipped 3-D preset on 8 ranks: tp 2 x pp 2 x FSDP 2, each rank holding an eighth of the weights; and
    tp 2 x pp 2 x 2 replicas (FSDP2 on a replicate-only mesh: the data-parallel half of HSDP)."""
    scenario = {
        "tp2_pp2_fsdp": ["parallel=tp2_pp2_fsdp", "train.micro_batch_size=4", "parallel.microbatches=2"],
        "tp2_pp2_ddp": [*TP2_PP2[:3], "parallel.dp_replicate=2", "train.micro_batch_size=4", "parallel.microbatches=2"],
    }
    runs = launch(run_pipeline_scenarios, 8, scenario, str(tmp_path))
    assert_same_curves(runs[0]["tp2_pp2_fsdp"], reference["single"])
    assert_same_curves(runs[0]["tp2_pp2_ddp"], reference["single"])
    norms = (2 * 2 + 1) * 64  # two per block and the final one, replicated over the tp ranks
    assert sum(r["tp2_pp2_fsdp"]["local_params"] for r in runs) == runs[0]["tp2_pp2_fsdp"]["params"] + norms


def test_packed_documents_through_the_stages_match_one_process(tmp_path):
    """Document masking under pp: every stage builds its chunk's mask from the batch's document ids (the schedule
    splits them with the batch), and the chunks' losses are token sums over the step's count (each EOS label is
    ignored, so chunks count different tokens): pp2 (2 chunks, 2 micro-batches), pp2 x FSDP 2 and cp2 x pp2 (each
    stage's mask places the rank's positions in the whole sequences) match one process, which a mean of chunk
    means would not. Under flex attention each stage builds its chunk's BlockMask (pp2, and cp2 x pp2 with the
    rank's positions)."""
    docs = document_data(tmp_path / "lines.jsonl")
    flex = "model.attention=flex"
    one = {"single": ["parallel=single", *docs], "single_flex": ["parallel=single", flex, *docs]}
    one = launch(run_pipeline_scenarios, 1, one, str(tmp_path / "one"))[0]
    two = {
        "pp2_docs": ["parallel=pp2", "train.micro_batch_size=4", "parallel.microbatches=2", *docs],
        "pp2_flex_docs": ["parallel=pp2", "train.micro_batch_size=4", "parallel.microbatches=2", flex, *docs],
    }
    got = launch(run_pipeline_scenarios, 2, two, str(tmp_path / "pp2"))[0]
    assert_same_curves(got["pp2_docs"], one["single"])
    assert_same_curves(got["pp2_flex_docs"], one["single_flex"])
    cp2_pp2 = ["parallel.cp=2", "parallel.pp=2", "parallel.dp_shard=1", "train.micro_batch_size=8", *docs]
    four = {
        "pp2_fsdp_docs": ["parallel=pp2_fsdp", "train.micro_batch_size=2", "parallel.microbatches=2", *docs],
        "cp2_pp2_docs": cp2_pp2,
        "cp2_pp2_flex_docs": [*cp2_pp2, flex],
    }
    runs = launch(run_pipeline_scenarios, 4, four, str(tmp_path / "pp2_fsdp"))
    assert_same_curves(runs[0]["pp2_fsdp_docs"], one["single"])
    assert_same_curves(runs[0]["cp2_pp2_docs"], one["single"])
    assert_same_curves(runs[0]["cp2_pp2_flex_docs"], one["single_flex"])


MOE = ["model=moe_tiny", "model.moe.aux_loss_coef=0.5"]  # a router loss large enough to move the curves
SIGMOID = ["model.moe.router=sigmoid_topk", "model.moe.bias_update_rate=0.01", "model.moe.aux_loss_coef=0.0"]
SIGMOID += ["model.moe.balanced_selection=false"]  # the sign updates; MOE's pp cases keep the preset's balancing


def test_moe_stages_match_one_process(tmp_path):
    """MoE blocks in pipeline stages: each stage's router losses join its chunk's output (no loss sent between
    stages), weighted 1 / the step's chunks as one process weighs its micro-batches; the sigmoid router's loads are
    tallied per chunk and summed over the token ranks only (the stages hold different layers). pp2 (2 chunks of 4)
    and tp2 x pp2 match one process with micro-batches of 4; pp2 x ep2 and pp2 x FSDP 2 with the sigmoid router
    (chunks of 2), with micro-batches of 2."""
    one = {
        "moe_micro4": ["parallel=single", "train.micro_batch_size=4", *MOE],
        "sigmoid_micro4": ["parallel=single", "train.micro_batch_size=4", *MOE, *SIGMOID],
        "moe_micro2": ["parallel=single", "train.micro_batch_size=2", *MOE],
        "sigmoid_micro2": ["parallel=single", "train.micro_batch_size=2", *MOE, *SIGMOID],
        "moe_micro2_4l": ["parallel=single", "train.micro_batch_size=2", *MOE, *FOUR_LAYERS],
    }
    two = {
        "pp2_moe": ["parallel=pp2", "train.micro_batch_size=8", "parallel.microbatches=2", *MOE],
        "pp2_sigmoid": ["parallel=pp2", "train.micro_batch_size=8", "parallel.microbatches=2", *MOE, *SIGMOID],
    }
    four = {
        "pp2_ep2": ["parallel=pp2_fsdp", "parallel.ep=2", "train.micro_batch_size=4", "parallel.microbatches=2", *MOE],
        "pp2_fsdp_sigmoid": [
            "parallel=pp2_fsdp",
            "train.micro_batch_size=4",
            "parallel.microbatches=2",
            *MOE,
            *SIGMOID,
        ],
        # zbv: the router losses join a stage output that torch's split backward detaches in place
        "pp2_ep2_zbv": [
            "parallel=pp2_fsdp",
            "parallel.ep=2",
            "parallel.pp_schedule=zbv",
            "train.micro_batch_size=4",
            "parallel.microbatches=2",
            *MOE,
            *FOUR_LAYERS,
        ],
    }
    want = launch(run_pipeline_scenarios, 1, one, str(tmp_path / "one"))[0]
    got = launch(run_pipeline_scenarios, 2, two, str(tmp_path / "two"))[0]
    assert_same_curves(got["pp2_moe"], want["moe_micro4"])
    assert_same_curves(got["pp2_sigmoid"], want["sigmoid_micro4"])
    four["tp2_pp2_moe"] = [*TP2_PP2, "parallel.microbatches=2", *MOE]  # the experts' widths split over tp
    got = launch(run_pipeline_scenarios, 4, four, str(tmp_path / "four"))[0]
    assert_same_curves(got["tp2_pp2_moe"], want["moe_micro4"])
    assert_same_curves(got["pp2_ep2"], want["moe_micro2"])
    assert_same_curves(got["pp2_fsdp_sigmoid"], want["sigmoid_micro2"])
    assert_same_curves(got["pp2_ep2_zbv"], want["moe_micro2_4l"])


def test_four_dimensional_layout_matches_one_process(tmp_path, reference):
    """tp 2 x cp 2 x pp 2 on 8 ranks: each stage tensor-parallel, each sequence split over the cp ranks."""
    scenario = {"tp2_cp2_pp2": ["parallel.tp=2", "parallel.cp=2", *TP2_PP2[1:]]}
    runs = launch(run_pipeline_scenarios, 8, scenario, str(tmp_path))
    assert_same_curves(runs[0]["tp2_cp2_pp2"], reference["single"])


def test_stage_sizes_are_as_even_as_the_count_allows():
    from forge.parallel.pipeline import stage_sizes

    assert stage_sizes(126, 8) == [15, 16, 16, 16, 16, 16, 16, 15]  # llama3_405b over pp8: the middle ones more
    assert stage_sizes(3, 2) == [2, 1] and stage_sizes(5, 4) == [1, 2, 1, 1] and stage_sizes(8, 4) == [2] * 4
    for layers in range(4, 40):
        for stages in range(1, 5):
            sizes = stage_sizes(layers, stages)
            assert sum(sizes) == layers and max(sizes) - min(sizes) <= 1, (layers, stages, sizes)
    # V schedules: rank r holds stages r and 2 pp - 1 - r; even per rank, and every stage holds a block
    assert stage_sizes(24, 16, v_shaped=True) == [2] * 8 + [1] * 8  # 3 per rank (stage-even: rank 7 held 4)
    for layers in range(4, 60):
        for pp in range(1, min(layers // 2, 8) + 1):
            sizes = stage_sizes(layers, 2 * pp, v_shaped=True)
            per_rank = [sizes[r] + sizes[2 * pp - 1 - r] for r in range(pp)]
            assert sum(sizes) == layers and min(sizes) >= 1, (layers, pp, sizes)
            assert max(per_rank) - min(per_rank) <= 1 and per_rank[0] == min(per_rank), (layers, pp, per_rank)
