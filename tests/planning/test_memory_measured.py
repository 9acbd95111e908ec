"""The layout search's peak memory per rank against the peak of live tensor bytes that torch's allocator reports
on real gloo ranks training with the real Trainer (forge.metrics.memory.peak_live_tensor_bytes): FSDP, GPipe (one
chunk's logit gradients at a time), 1F1B (each rank's own in-flight chunks, one at the head; the run's closing
evaluation kept every chunk's logits and their concatenation, 0.82, until it asked torch's schedule for no
outputs), DDP (one micro-batch: the gradients come as the backward frees the activations; FSDP2's gather copies
of the replicas), TP (the logits split over the vocabulary), TP of an MoE, tp2 x pp2 on 4 ranks, tp2 x pp2 x
FSDP 2 on 8, MoE layouts on 4 and the zero-bubble schedules (their deferred weight gradients keep about pp chunks
alive). Within 15 %, the search issue's bound; benchmarks/search/predict_vs_measured.py does all eleven layouts of
its table."""

import pytest
from torch.profiler import ProfilerActivity, profile

from forge.config import compose
from forge.metrics.memory import peak_live_tensor_bytes
from forge.planning.search.cost import Layout, ModelShape, predict
from forge.planning.search.devices import DEVICES
from forge.planning.search.settings import SearchSettings
from forge.train import build
from forge.train.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.scenarios import temp_root

pytestmark = pytest.mark.dist

MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.ffn_dim=768", "train.seq_len=128",
         "train.global_batch_size=16", "train.dtype=fp32", "train.threads=1", "train.steps=2", "train.eval_every=0",
         "train.eval_batches=1", "scheduler.warmup_steps=1", "metrics.console=quiet"]  # fmt: skip
LAYOUTS = {
    "fsdp2": Layout(1, 2, 1, 1, 1, "none", 8),
    "pp2_gpipe": Layout(1, 1, 1, 2, 1, "none", 16, "gpipe", 4),
    "pp2_1f1b": Layout(1, 1, 1, 2, 1, "none", 16, "1f1b", 4),
    "ddp2": Layout(2, 1, 1, 1, 1, "none", 8),
    "tp2": Layout(1, 1, 2, 1, 1, "none", 8),
    "tp2_moe": Layout(1, 1, 2, 1, 1, "none", 8),
    "tp2_pp2": Layout(1, 1, 2, 2, 1, "none", 16, "1f1b", 4),  # 4 ranks; measured 0.98
    "tp2_pp2_fsdp2": Layout(1, 2, 2, 2, 1, "none", 8, "1f1b", 4),  # 8 forked ranks; measured 1.05
    "pp2_zbv": Layout(1, 1, 1, 2, 1, "none", 16, "zbv", 4),  # measured 0.99
    "pp2_interleaved_zb": Layout(1, 1, 1, 2, 1, "none", 16, "interleaved_zb", 4),  # measured 1.03
    "pp2_fsdp2_zbv": Layout(1, 2, 1, 2, 1, "none", 8, "zbv", 4),  # 4 ranks, the stage gathered through the step
    # MoE layouts on 4 ranks, measured 0.97 and 0.95 (0.81 and 0.88 before the estimate counted the routing's token
    # copies, expert outputs and router scores, whole on every tp rank); tp2 x ep2 read 0.94 (0.87) and pp2 x ep2
    # 1.02 (0.92) when run alone (pp2 x ep2 under the profiler once failed in the suite's worker to resolve a
    # process group in its gradient clipping)
    "tp4_moe": Layout(1, 1, 4, 1, 1, "none", 16),
    "cp2_ep2_moe": Layout(1, 2, 1, 1, 2, "none", 8, cp=2),
}
MOE = ["model=moe_tiny", "model.n_kv_heads=8", "model.moe.expert_ffn_dim=256"]
EXTRA = {name: MOE for name in LAYOUTS if name.endswith("_moe")}
"""Overrides of a layout's own model (tp2_moe: the experts split on their width by tp, measured 0.93 of the peak)."""


def train_under_the_profiler(overrides: list[str], root: str) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        Trainer(compose(overrides), f"{root}/run").fit()
    return peak_live_tensor_bytes(prof)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_peak_memory_is_within_15_percent_of_the_ranks_measured_peak(name):
    layout = LAYOUTS[name]
    overrides = [*EXTRA.get(name, [])[:1], *MODEL, *EXTRA.get(name, [])[1:], *layout.overrides()]
    # with data parallelism the highest of two runs: when FSDP's prefetched block meets the peak depends on the
    # ranks' timing (the measured peak moves by up to 7 % between runs)
    world = layout.dp * layout.tp * layout.pp * layout.cp
    runs = 2 if layout.dp > 1 else 1
    measured = max(max(launch(train_under_the_profiler, world, overrides, temp_root())) for _ in range(runs))
    cfg = compose([*overrides, f"parallel.world_size={world}"])
    shape = ModelShape.of(build.build_meta_model(cfg))
    predicted = predict(layout, shape, cfg.train, DEVICES["h100"], SearchSettings(), "fp32").memory
    assert predicted == pytest.approx(measured, rel=0.15), (predicted / measured, measured)
