"""`forge-train --plan`: the layout of a large run on a fake process group, with nothing allocated."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge.config import compose
from forge.planning.report import estimate_memory, plan_report, take_plan_flag

FORGE_TRAIN = Path(sys.executable).parent / "forge-train"


def test_take_plan_flag_strips_it_before_hydra():
    argv = ["forge-train", "--plan", "model=llama3_8b"]
    assert take_plan_flag(argv) and argv == ["forge-train", "model=llama3_8b"]
    assert not take_plan_flag(argv)


PEAK_OF_CHILD = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)"
)
"""Runs a command and prints its peak RSS (KiB) last on stderr: the test process's own children include earlier
tests' training runs (RUSAGE_CHILDREN is the largest of them all)."""


def test_plan_of_llama3_8b_on_32_ranks_is_quick_and_allocates_nothing(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK_OF_CHILD,
            str(FORGE_TRAIN),
            "--plan",
            "model=llama3_8b",
            "parallel=tp4_fsdp",
            "parallel.world_size=32",
        ],  # fmt: skip
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    total, local = (
        int(n.replace(",", "")) for n in re.search(r"total ([\d,]+) \| rank 0 holds ([\d,]+)", out).groups()
    )
    assert 7.5e9 < total < 8.5e9
    assert local == pytest.approx(total / 32, rel=0.02)  # FSDP pads the last shards a little
    assert "mesh: {'dp_shard': 8, 'tp': 4}" in out
    assert "tensor parallel over 4 ranks" in out and "FSDP over mesh" in out
    assert "FLOPs per token" in out and "estimated peak memory per rank" in out
    # An 8B model in fp32 is 32 GB: a peak under 1.5 GiB means only meta tensors were made.
    assert int(proc.stderr.split()[-1]) * 1024 < 1.5 * 2**30


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_memory_estimate_matches_measured_peak_of_a_cpu_step(dtype):
    """The estimate of a CPU step against the peak of live tensor bytes that torch's allocator reports (the process
    RSS adds glibc's caches: the estimate read 0.5-0.9 of its growth on different machines; benchmarks/ measure it).
    bf16 is the trainer's one-process step: a bf16 copy of the weights, norms in fp32 under autocast."""
    script = Path(__file__).with_name("measure_memory.py")
    proc = subprocess.run([sys.executable, str(script), dtype], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    measured, estimated = (float(x) for x in proc.stdout.split()[-2:])
    # The estimate read 1.00 of it in fp32 and 0.98 in bf16 (the loss's 4 MiB fp32 chunk of rows is not counted).
    # The count is the same on every machine, so 3 % can still tell a missing term. fp32 / bf16: leaving out
    # AdamW's two moments reads 0.86 / 0.78, counting the gradients at the activations' peak 1.07 / 1.09; bf16:
    # leaving out the bf16 copy of the weights 0.93, the norms' fp32 copies of their inputs 0.955.
    assert estimated == pytest.approx(measured, rel=0.03), proc.stdout


def test_report_runs_in_process_for_one_rank():
    text = plan_report(compose(["model=llama_tiny", "parallel=single"]))
    assert "mesh: none (one process)" in text and "(1.0000 of the model" in text


def test_plan_of_ep2_fsdp_shows_the_expert_split_and_per_rank_parameters():
    text = plan_report(compose(["model=moe_tiny", "parallel=ep2_fsdp", "parallel.world_size=4"]))
    assert "mesh: {'dp_shard_mod_ep': 2, 'ep': 2}" in text
    assert "expert parallel over 2 ranks" in text and "4 of 8 experts per rank" in text
    total, local = (
        int(n.replace(",", "")) for n in re.search(r"total ([\d,]+) \| rank 0 holds ([\d,]+)", text).groups()
    )
    experts, local_experts = (
        int(n.replace(",", ""))
        for n in re.search(r"routed expert parameters: total ([\d,]+), rank 0 holds ([\d,]+)", text).groups()
    )
    # Experts: 1/2 by ep x 1/2 by FSDP over dp_shard_mod_ep; the rest: 1/4 by FSDP over all 4 ranks.
    assert local_experts == experts // 4
    assert local - local_experts == pytest.approx((total - experts) / 4, rel=0.01)


def test_checkpointing_shrinks_the_activation_estimate():
    from forge.config.degrees import Degrees
    from forge.train.build import model_args

    args = model_args(compose(["model=llama3_8b"]))
    mem = estimate_memory(args, Degrees(1, 1, 1, 1, 1), 10**9, 32, True, 1, 8192, 1.0, 2)
    assert mem.activations_checkpointed < 0.3 * mem.activations  # the 128k-vocab head stays
    assert torch.tensor(mem.peak(True)) < mem.peak(False)


def test_plan_of_tied_embeddings_on_four_stages_names_the_gradient_exchange():
    """The shipped llama3_1b (tied) on pp 4 x FSDP 16: the first and last stage's group is created as a run would,
    and the line states the bytes of the embedding gradient each of them all-reduces per step."""
    cfg = compose(["model=llama3_1b", "parallel=pp2_fsdp", "parallel.pp=4", "parallel.world_size=64",
                   "train.global_batch_size=256"])  # fmt: skip
    text = plan_report(cfg)
    line = next(line for line in text.splitlines() if line.startswith("tied embeddings"))
    assert "stages 0 and 3" in line
    vocab, dim = cfg.model.vocab_size, cfg.model.dim
    assert f"{vocab * dim // 16:,} elements" in line  # this rank's FSDP shard of the matrix


def saved_activation_bytes(loss_fn, model: torch.nn.Module) -> int:
    """Bytes of the tensors autograd saves for the backward of `loss_fn()` (each storage once), leaving out
    `model`'s parameters (the matmuls save their weights: memory the estimate counts as parameters)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn()
    return sum(storages.values())


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_activation_estimate_matches_what_autograd_saves_on_a_context_parallel_rank(cp):
    """One cp rank's forward, simulated in one process: its attention layers get the shapes of the cp gather
    (the rank's keys and values repeated cp times), its queries the rank's positions, its mask the documents'.
    The estimate's activations (with the gathered keys and values and the per-block masks; cp 1 is a plain run
    with document masking) must be within 15 %."""
    import torch.nn.functional as F

    from forge.config.degrees import Degrees
    from forge.models.common.attention import DocumentMask
    from forge.models.llama import TransformerArgs
    from forge.models.llama.transformer import Attention, build_transformer
    from forge.parallel.context_parallel import chunk_positions, gathered_positions

    batch, seq = 2, 512
    args = TransformerArgs(dim=128, n_layers=4, n_heads=4, vocab_size=512, ffn_dim=512, max_seq_len=seq)
    model = build_transformer(args)
    for module in model.modules():
        if isinstance(module, Attention) and cp > 1:
            module.gather_kv = lambda t: torch.cat([t] * cp, dim=2)
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    queries = chunk_positions(seq, cp, 0)
    mask = DocumentMask(torch.arange(seq).div(40, rounding_mode="floor").expand(batch, seq), queries)
    if cp > 1:
        mask = DocumentMask(mask.doc_ids, queries, gathered_positions(seq, cp))

    def loss():
        logits = model(tokens[:, queries], attn_mask=mask)
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, queries].flatten())

    measured = saved_activation_bytes(loss, model)
    n = sum(p.numel() for p in model.parameters())
    degrees = Degrees(1, 1, 1, 1, 1, cp)
    estimated = estimate_memory(args, degrees, n, args.n_layers, True, batch, seq, 1.0, 4, dense_masks=True)
    assert estimated.activations == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_activation_estimate_matches_what_autograd_saves_under_latent_attention(q_lora_rank):
    """MLA keeps its latents and per-head widths, not GQA's (values padded to the query width for SDPA's fused
    kernel): the estimate is within 15 % of the bytes autograd saves."""
    import torch.nn.functional as F

    from forge.config.degrees import Degrees
    from forge.models.llama import TransformerArgs
    from forge.models.llama.args import MLAArgs
    from forge.models.llama.transformer import build_transformer

    batch, seq = 2, 512
    mla = MLAArgs(q_lora_rank=q_lora_rank, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    args = TransformerArgs(dim=128, n_layers=4, n_heads=4, vocab_size=512, ffn_dim=512, max_seq_len=seq,
                           attention_kind="mla", mla=mla)  # fmt: skip
    model = build_transformer(args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    measured = saved_activation_bytes(
        lambda: F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()), model
    )
    n = sum(p.numel() for p in model.parameters())
    estimated = estimate_memory(args, Degrees(1, 1, 1, 1, 1), n, args.n_layers, True, batch, seq, 1.0, 4)
    assert estimated.activations == pytest.approx(measured, rel=0.15)


def test_gradients_exist_at_the_activations_peak_only_after_a_backward():
    """torch's schedules: 1F1B runs pp - rank warm-up forwards (all of them on rank 0 when chunks = pp), the
    interleaved one (stages - 1) rounds + 2 (pp - 1 - rank) stage forwards, GPipe every forward first."""
    from forge.planning.memory import grads_at_peak

    assert grads_at_peak(2, 1, "1f1b")  # gradient accumulation
    assert not grads_at_peak(1, 1, "1f1b")
    assert not grads_at_peak(1, 2, "gpipe", chunks=8)
    assert not grads_at_peak(1, 2, "1f1b", chunks=2, pp_rank=0)
    assert grads_at_peak(1, 2, "1f1b", chunks=2, pp_rank=1)
    assert grads_at_peak(1, 2, "1f1b", chunks=4, pp_rank=0)
    assert not grads_at_peak(1, 2, "interleaved_1f1b", chunks=2, pp_rank=0, stages=2)  # 4 warm-up of 4
    assert grads_at_peak(1, 2, "interleaved_1f1b", chunks=2, pp_rank=1, stages=2)  # 2 warm-up of 4
    assert grads_at_peak(1, 2, "interleaved_1f1b", chunks=4, pp_rank=0, stages=2)


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (2, 3), (2, 4), (4, 4), (4, 8), (4, 6), (8, 16)])
def test_in_flight_chunks_follow_torchs_schedules(pp, microbatches):
    """Each pipeline rank's in-flight share against torch's own warm-up counts (its interleaved schedule's
    helper; 1F1B warms up pp - rank chunks on rank r, at most all of them)."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    from forge.planning.memory import head_in_flight, interleaved_warmup, pipeline_in_flight

    per_round = microbatches // max(1, microbatches // pp)
    for rank in range(pp):
        torch_warmup = _get_warmup_ops(rank, 2, per_round, pp, microbatches)
        assert interleaved_warmup(pp, microbatches, rank, 2) == torch_warmup
        assert pipeline_in_flight(pp, "interleaved_1f1b", microbatches, rank, 2) == pytest.approx(
            min(2 * microbatches, torch_warmup + 1) / (2 * microbatches)
        )
        assert pipeline_in_flight(pp, "1f1b", microbatches, rank) == min(microbatches, pp - rank) / microbatches
        assert pipeline_in_flight(pp, "gpipe", microbatches, rank) == 1.0
    assert head_in_flight(pp, "1f1b", microbatches) == head_in_flight(pp, "interleaved_1f1b", microbatches)
    assert head_in_flight(pp, "1f1b", microbatches) == 1 / microbatches
    assert head_in_flight(pp, "gpipe", microbatches) is None and head_in_flight(1, "1f1b", 1) is None
