"""`forge-train --plan --search`: the rows are the fastest predicted layouts that validation accepts, the memory
column is `--plan`'s estimate, and each term of the cost model moves the way its formula says."""

import dataclasses
import re
import subprocess

import pytest
import torch

from forge.config import compose, validate
from forge.planning.report import plan_report
from forge.planning.search.cost import Layout, Links, ModelShape, latency_share, predict
from forge.planning.search.devices import DEVICES, GIB
from forge.planning.search.report import search, search_report, settings_of, valid
from forge.train import build
from tests.conftest import ROOT, forge_cmd


def searched(*overrides: str):
    return compose(["search=default", *overrides])


def test_rows_are_the_fastest_layouts_validation_accepts():
    """A compiled MoE model on 8 ranks: every candidate validated one by one; the table lists the first valid ones
    in the predicted order, and the refused ones (tensor-parallel MoE under compile, among others) never appear."""
    cfg = searched("model=moe_tiny", "parallel.world_size=8", "search.top=6", "parallel.compile=true")
    fitting, considered, _ = search(cfg.copy())
    refusals = [valid(cfg, p) for p in fitting]
    accepted = [p for p, refusal in zip(fitting, refusals) if refusal is None]
    assert len(accepted) < len(fitting) <= considered  # some candidates are refused
    refused = [p.layout for p, refusal in zip(fitting, refusals) if refusal is not None]
    assert any(layout.tp > 1 for layout in refused) and all(p.layout.tp == 1 for p in accepted)
    text = search_report(cfg)
    rows = [line for line in text.splitlines() if re.match(r"\s*\d+\s+rep", line)]
    assert [row.split(maxsplit=1)[1][:58].strip() for row in rows] == [p.layout.short() for p in accepted[:6]]


def test_the_winner_passes_validation_as_the_overrides_it_prints():
    cfg = searched("model=llama_tiny", "parallel.world_size=8", "train.global_batch_size=64")
    text = search_report(cfg)
    winner = next(line for line in text.splitlines() if line.startswith("winner: ")).split()[1:]
    degrees = validate(compose(["model=llama_tiny", "parallel.world_size=8", "train.global_batch_size=64", *winner]))
    assert degrees.world_size == 8
    assert "runner-up (other degrees)" in text


@pytest.mark.parametrize(
    ("model", "world", "layout"),
    [
        ("llama3_8b", 16, Layout(1, 8, 2, 1, 1, "none", 1)),
        ("llama3_70b", 64, Layout(4, 4, 4, 1, 1, "full", 4)),
        ("llama3_1b", 8, Layout(1, 2, 1, 4, 1, "none", 8, "interleaved_1f1b", 8)),  # tied, pipelined
        ("llama3_1b", 6, Layout(1, 2, 1, 3, 1, "none", 8, "gpipe", 8)),  # 16 blocks on 3 stages: 5, 6, 5
        ("llama3_1b", 8, Layout(1, 2, 1, 4, 1, "full", 8, "interleaved_1f1b", 8)),  # busiest with checkpointing
        ("llama3_8b", 16, Layout(1, 2, 2, 1, 1, "full", 1, cp=4)),  # context parallel x TP x FSDP
        ("llama3_8b", 16, Layout(1, 2, 2, 4, 1, "none", 8, "zbv", 8)),  # zero-bubble: the stage gathered, grads whole
        ("llama3_1b", 8, Layout(2, 1, 1, 4, 1, "none", 8, "interleaved_zb", 8)),  # over replicas: FSDP2's copies
        ("llama3_1b", 8, Layout(2, 1, 1, 4, 1, "none", 8, "1f1b", 8)),  # DDP's stage kept gathered from its backward
    ],
)
def test_memory_is_the_plans_estimate(model, world, layout):
    """The search counts each rank's parameters from the blocks' sizes; `--plan` shards the meta model under the
    fake process group. Both give the busiest pipeline rank's peak (`--plan` prints rank 0's, and the busiest
    one's where another pipeline rank's is higher)."""
    cfg = searched(f"model={model}", f"parallel.world_size={world}", "train.global_batch_size=64", *layout.overrides())
    planned = plan_report(cfg.copy())
    group = 2 if layout.activation_checkpoint == "full" else 1
    peak = float(re.search(r"peak ([\d.]+) GiB without checkpointing, ([\d.]+) GiB with", planned).group(group))
    busiest = re.search(r"busiest pipeline rank: pipeline rank \d+ .*peak ([\d.]+) GiB without checkpointing, "
                        r"([\d.]+) GiB with", planned)  # fmt: skip
    assert (busiest is not None or "busiest pipeline rank: rank 0" in planned) == (layout.pp > 1), planned
    if busiest:
        peak = float(busiest.group(group))
    settings = settings_of(cfg)
    shape = ModelShape.of(build.build_meta_model(cfg))
    got = predict(layout, shape, cfg.train, DEVICES["h100"], settings).memory / GIB
    assert got == pytest.approx(peak, rel=0.01, abs=0.01)


def test_the_plan_counts_each_pipeline_ranks_own_moe_blocks():
    """12 blocks on 4 pipeline ranks, the first 6 dense: ranks 1 and 2 have stages of the same size but rank 1's
    blocks are dense and rank 2's MoE, so they hold different shards. What the plan counts for each rank (each kind
    of rank parallelized once) equals that rank's own stage modules, parallelized afresh."""
    from forge.config import validate
    from forge.parallel.mesh import build_mesh
    from forge.parallel.pipeline import build_stage_module, rank_stages
    from forge.parallel.plan import parallelize
    from forge.planning.report import RankParts, compute_dtype, fake_process_group, pipeline_rank_parts

    cfg = searched("model=moe_tiny", "model.n_layers=12", "model.moe.first_dense=6", "parallel.world_size=4",
                   "parallel.pp=4", "parallel.dp_shard=1", "train.micro_batch_size=8")  # fmt: skip
    degrees = validate(cfg, 4)
    with fake_process_group(4):
        mesh = build_mesh(degrees, "cpu")
        model = build.build_meta_model(cfg)
        counted = pipeline_rank_parts(cfg, degrees, mesh, model)
        for pp_rank, held in counted.items():
            parts = [build_stage_module(model, s, 4) for s in rank_stages(cfg.parallel.pp_schedule, 4, pp_rank)]
            for part in parts:
                parallelize(part, mesh, degrees, cfg.parallel, torch.device("cpu"), compute_dtype(cfg))
            assert held == RankParts.of(parts), pp_rank
    assert counted[1].local_experts == 0 < counted[2].local_experts == counted[3].local_experts


def test_terms_follow_their_formulas():
    cfg = searched("model=llama3_8b", "parallel.world_size=64", "train.seq_len=4096", "train.global_batch_size=256")
    settings, shape, h100 = settings_of(cfg), ModelShape.of(build.build_meta_model(cfg)), DEVICES["h100"]
    fsdp = Layout(1, 64, 1, 1, 1, "none", 1)  # one group over 8 nodes: inter-node
    base = predict(fsdp, shape, cfg.train, h100, settings)
    assert base.seconds["tp"] == base.seconds["bubble"] == base.seconds["recompute"] == 0
    full = predict(dataclasses.replace(fsdp, activation_checkpoint="full"), shape, cfg.train, h100, settings)
    assert full.seconds["recompute"] == pytest.approx(
        base.seconds["compute"] / 3, rel=0.1
    )  # one more forward of the blocks
    assert full.memory < base.memory
    faster_net = dataclasses.replace(settings, inter_node_gbps=400.0)
    assert predict(fsdp, shape, cfg.train, h100, faster_net).seconds["exposed_dp"] < base.seconds["exposed_dp"]
    tp = predict(Layout(1, 8, 8, 1, 1, "none", 1), shape, cfg.train, h100, settings)
    assert tp.seconds["tp"] > 0 and tp.seconds["compute"] == pytest.approx(base.seconds["compute"], rel=1e-6)
    two, eight = (
        predict(Layout(1, 32, 1, 2, 1, "none", m, "1f1b", m), shape, cfg.train, h100, settings) for m in (2, 8)
    )
    assert two.seconds["bubble"] == pytest.approx(4 * eight.seconds["bubble"], rel=1e-6)  # (pp - 1) / m
    shared = dataclasses.replace(h100, shares_cores=True)  # ranks sharing a CPU host's cores: no idle bubble
    pooled = predict(Layout(1, 32, 1, 2, 1, "none", 2, "1f1b", 2), shape, cfg.train, shared, settings)
    assert two.seconds["bubble"] > 0 and pooled.seconds["bubble"] == 0
    # and its data-parallel collectives run on the cores that compute: none hidden behind the backward
    assert two.seconds["exposed_dp"] < pooled.seconds["exposed_dp"]
    hidden = pooled.seconds["exposed_dp"] - two.seconds["exposed_dp"]
    assert pooled.step == pytest.approx(two.step - two.seconds["bubble"] + hidden, rel=1e-6)
    # a calibrated latency (ranks sharing a CPU host's cores wait a time slice per collective) replaces the table's
    slow = dataclasses.replace(h100, latency_s=5e-3)
    for layout in (fsdp, Layout(1, 8, 8, 1, 1, "none", 1)):  # inter-node FSDP; TP inside a node, FSDP across
        table, measured = (predict(layout, shape, cfg.train, dev, settings) for dev in (h100, slow))
        calls = measured.seconds["latency"] / 5e-3
        assert calls == pytest.approx(round(calls)) and calls > 0
        assert table.seconds["latency"] < measured.seconds["latency"]
        assert measured.step - table.step == pytest.approx(measured.seconds["latency"] - table.seconds["latency"])
    # measured over 8 ranks: groups of 8 pay all of it, tp2's collectives log2(2) / log2(8) of it
    over8 = dataclasses.replace(slow, latency_ranks=8)
    tp8, tp2 = Layout(1, 8, 8, 1, 1, "none", 1), Layout(1, 32, 2, 1, 1, "none", 1)
    for layout, share in ((tp8, 1.0), (tp2, 1 / 3)):
        whole, scaled = (predict(layout, shape, cfg.train, dev, settings) for dev in (slow, over8))
        links = Links(layout, over8, settings)
        assert links.latency_share["tp"] == pytest.approx(share)
        assert links.seconds("tp", 0.0, 1)[1] == pytest.approx(share * 5e-3)
        assert (scaled.seconds["latency"] < whole.seconds["latency"]) == (share < 1)
    assert [latency_share(g, 8) for g in (1, 2, 4, 8, 64)] == pytest.approx([1, 1 / 3, 2 / 3, 1, 1])
    assert latency_share(4, None) == latency_share(4, 1) == 1.0


def test_long_sequences_make_the_search_split_them_over_context_parallel_ranks():
    """At 64k tokens a sequence's activations do not fit one H200 (and cp divides the compute without moving the
    weights again): the winner splits it. At 4k the same split only adds the key/value traffic."""
    long = searched("model=llama3_8b", "parallel.world_size=64", "train.seq_len=65536", "model.max_seq_len=65536",
                    "train.global_batch_size=64", "search.device=h200")  # fmt: skip
    fitting, _, _ = search(long.copy())
    winner = next(p for p in fitting if valid(long, p) is None)
    assert winner.layout.cp > 1 and winner.seconds["cp"] > 0 and winner.moved["cp"] > 0
    assert not any(p.layout.cp == 1 and p.layout.tp == 1 and p.layout.activation_checkpoint == "none"
                   for p in fitting)  # fmt: skip
    short = searched("model=llama3_8b", "parallel.world_size=64", "train.seq_len=4096", "train.global_batch_size=64")
    settings, shape, h200 = settings_of(short), ModelShape.of(build.build_meta_model(short)), DEVICES["h200"]
    one, two = (predict(Layout(1, 64 // cp, 1, 1, 1, "full", 1, cp=cp), shape, short.train, h200, settings)
                for cp in (1, 2))  # fmt: skip
    assert two.seconds["compute"] == pytest.approx(one.seconds["compute"], rel=1e-6)  # the same tokens per rank
    assert two.seconds["cp"] > 0 == one.seconds["cp"] and two.step > one.step


def test_an_unknown_device_is_refused_with_one_line(tmp_path):
    """The README's search command runs in tests/test_readme.py; here a bad device through the command line."""
    cmd = forge_cmd("--plan", "--search", "search.device=tpu9", f"hydra.run.dir={tmp_path}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "search.device='tpu9' is not one of" in lines[0], lines


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["forge-train", "--search", "model=llama_tiny"], "--search works only with --plan"),
        (["forge-train", "--plan", "--search-top"], "--search-top takes a number"),
        (["forge-train", "--plan", "--search-top", "0"], "--search-top takes a number"),
    ],
)
def test_bad_search_flags_exit_2_with_one_line(argv, says, capsys):
    from forge.planning.report import take_plan_flag

    with pytest.raises(SystemExit) as exit_info:
        take_plan_flag(list(argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and says in lines[0]


def test_search_flags_become_overrides_after_hydras_own_flags():
    from forge.planning.report import take_plan_flag

    argv = ["forge-train", "-cn", "train", "--plan", "--search-top", "3", "model=llama3_8b"]
    assert take_plan_flag(argv)
    assert argv == ["forge-train", "-cn", "train", "model=llama3_8b", "search=default", "search.top=3"]
    argv = ["forge-train", "--plan", "search.device=h200"]  # a search key alone selects the search
    assert take_plan_flag(argv) and argv == ["forge-train", "search.device=h200", "search=default"]


@pytest.mark.parametrize(
    "override",
    ["search.compute_efficiency=0", "search.comm_efficiency=1.5", "search.memory_headroom=1", "search.top=0"],
)
def test_settings_out_of_range_are_named(override):
    from forge.config import ConfigError

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=.* must be"):
        search_report(searched("model=llama_tiny", "parallel.world_size=8", override))


def test_one_candidate_of_each_layout_validates():
    """Every degree the search enumerates reaches the candidate (pipeline stages with context parallelism included),
    so a model and world that validation refuses nothing for get no refused candidate among one of each layout
    (degrees and schedule), and the 3-D and 4-D layouts are among them."""
    cfg = searched("model=moe_tiny", "parallel.world_size=8")
    fitting, _, _ = search(cfg.copy())
    one_each = {(p.layout.degrees_tuple(), p.layout.pp_schedule): p for p in fitting}.values()  # of each layout
    assert [valid(cfg, p) for p in one_each] == [None] * len(one_each)
    degrees = {(p.layout.tp > 1, p.layout.pp > 1, p.layout.cp > 1, p.layout.ep > 1) for p in fitting}
    # (tp, pp, cp, ep) > 1: pp x cp, tp x pp x cp, tp x ep, pp x ep, cp x ep, tp x pp x ep
    no, yes = False, True
    wanted = {(no, yes, yes, no), (yes, yes, yes, no), (yes, no, no, yes), (no, yes, no, yes), (no, no, yes, yes)}
    assert wanted | {(yes, yes, no, yes)} <= degrees
