"""forge's training step against transformers' LlamaForCausalLM, eager and compiled, side by side in one run.

    .venv/bin/python benchmarks/train/vs_transformers.py [--shape 256:4:256:8 --shape 1024:4:512:4 --dtype auto
        --steps 3 --no-compile --profile 15 --profile-all --lean --whole-model --cuda-graphs --device cuda]

A shape is dim:layers:seq:batch (heads = dim / 64, vocab 8192, SwiGLU hidden 4 x dim). For each shape, the
contenders take AdamW steps on the same random tokens, in turns, so the machine's noise hits all alike:
- forge eager: the trainer's one-process step (autocast in the resolved dtype, forge's row-wise fp32
  cross-entropy, fused AdamW; under bf16, one bf16 copy of the fp32 weights per step, forge.train.compute_weights);
- under bf16, forge eager with fp32 weights under autocast (`parallel.param_dtype=fp32`): what the copies save;
- forge eager, torch's AdamW choice (`optimizer.fused=false`): what the fused kernel saves;
- forge eager, torch's cross-entropy (F.cross_entropy of the fp32 logits, as transformers'): what the row-wise
  loss saves;
- forge compiled: the per-block torch.compile, with the loss eager (row-wise);
- forge compiled, compiled loss: what `parallel.compile=true` trains with (blocks and cross-entropy compiled);
- (--whole-model) forge compiled as one graph, compiled loss: `parallel.compile_scope=model` (the whole forward);
- transformers eager and transformers compiled (`torch.compile` of the whole HF model), with the same fused AdamW
  and torch's cross-entropy of the fp32 logits (what transformers' own loss computes); and transformers compiled
  with the same compiled cross-entropy as forge's.
Each row gives tokens/s (of the median step: one step slowed by another job does not move it), the ratio to
transformers eager and to transformers compiled, and the MFU against the matmul peak measured in the same run (the
best of square products and the model's widest product, in bursts between the rounds of steps, each followed by an
untimed step: the rate when nothing else runs). FLOPs per token are forge.planning.flops', as the trainer's MFU.
After the table, a per-op profile of one forge eager step (self CPU time, or self GPU time on a GPU; top --profile
ops); `--profile-all` profiles every contender.

On a GPU (`--device cuda`, as benchmarks/gpu.sh runs it) each step is timed between CUDA synchronizations and
the profile is by self GPU time. The CPU flags are printed first: with avx512_bf16 / amx_bf16, `--dtype auto` is
bf16; without, fp32. By default every contender runs under glibc's and torch's own host memory; `--host-memory
forge` runs them all under what forge-train sets for one CPU process (its heap kept, transparent huge pages).
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.*

from benchmarks.machine import cpu_flags, gpu_note, synchronizer  # noqa: E402
from benchmarks.train.mfu import parse_shape, peak_flops, shape_args  # noqa: E402
from forge.models.llama import TransformerArgs, build_transformer  # noqa: E402
from forge.parallel.plan import apply_compile  # noqa: E402
from forge.planning.flops import count_flops_per_token  # noqa: E402
from forge.runtime.host_memory import ask_huge_pages, keep_heap  # noqa: E402
from forge.train.compute_weights import ComputeWeights, scope  # noqa: E402
from forge.train.losses import compiled_cross_entropy, cross_entropy  # noqa: E402
from forge.train.precision import autocast, resolve_dtype  # noqa: E402

VOCAB = 8192


def torch_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def step_fn(
    model: torch.nn.Module,
    logits_of: Callable,
    fused: bool,
    tokens: torch.Tensor,
    dtype: str,
    loss_of: Callable = torch_cross_entropy,
    weights: ComputeWeights | None = None,
) -> Callable:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def step() -> None:
        with scope(weights):
            with autocast(tokens.device, dtype):
                logits = logits_of(model, tokens[:, :-1])
            loss = loss_of(logits, tokens[:, 1:])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def forge_step(args: TransformerArgs, tokens: torch.Tensor, dtype: str, **options) -> Callable:
    """forge's one-process step: `compile` "blocks" (parallel.compile=true), "block graphs" (+ parallel.cuda_graphs
    =true), "model" (+ parallel.compile_scope=model: the whole forward as one graph) or "graphs" (+ both: that
    graph replayed as CUDA graphs), through the trainer's apply_compile; `copies` (under bf16) on one bf16 copy of
    the weights, as the trainer's (at fixed addresses under CUDA graphs)."""
    model = build_transformer(args, tokens.device)
    how = options.pop("compile", None)
    graphs = how in ("block graphs", "graphs")
    copies = dtype == "bf16" and options.pop("copies", True)
    weights = ComputeWeights(model, fixed=graphs) if copies else None
    if how is not None:
        apply_compile(model, cuda_graphs=graphs, scope="model" if how in ("model", "graphs") else "blocks")
    loss_of = options.pop("loss_of", cross_entropy)
    fused = options.pop("fused", True)
    logits_of = lambda m, x: m(x)  # noqa: E731
    return step_fn(model, logits_of, fused, tokens, dtype, loss_of=loss_of, weights=weights, **options)


def contenders(
    dim: int,
    layers: int,
    seq: int,
    tokens: torch.Tensor,
    dtype: str,
    compile_: bool,
    lean: bool,
    whole: bool,
    graphs: bool = False,
) -> dict:
    """The steps to time, by name; `lean` keeps forge eager, forge's best setting and transformers' three (no
    ablation rows); `whole` adds forge's whole forward compiled as one graph, as transformers' is
    (`parallel.compile_scope=model`); `graphs` the per-block graphs and that one graph replayed as CUDA graphs, as
    `parallel.cuda_graphs=true` runs them (bf16 copies at fixed addresses)."""
    args = shape_args(dim, layers, seq, VOCAB)
    hf_config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=max(1, dim // 64),
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    theirs = lambda m, x: m(x).logits  # noqa: E731
    hf_model = lambda: LlamaForCausalLM(hf_config).to(tokens.device)  # noqa: E731
    runs = {"forge eager": forge_step(args, tokens, dtype)}
    if not lean:
        if dtype == "bf16":
            runs["forge eager, fp32 weights under autocast"] = forge_step(args, tokens, dtype, copies=False)
        runs["forge eager, torch's AdamW choice"] = forge_step(args, tokens, dtype, fused=False)
        runs["forge eager, torch's cross-entropy"] = forge_step(args, tokens, dtype, loss_of=torch_cross_entropy)
    runs["transformers eager"] = step_fn(hf_model(), theirs, True, tokens, dtype)
    if compile_:
        loss = compiled_cross_entropy()
        if not lean:
            runs["forge compiled"] = forge_step(args, tokens, dtype, compile="blocks")
        runs["forge compiled, compiled loss"] = forge_step(args, tokens, dtype, compile="blocks", loss_of=loss)
        if whole:
            runs["forge compiled as one graph, compiled loss"] = forge_step(
                args, tokens, dtype, compile="model", loss_of=loss
            )
        if graphs:
            runs["forge compiled (blocks), CUDA graphs, compiled loss"] = forge_step(
                args, tokens, dtype, compile="block graphs", loss_of=loss
            )
            runs["forge compiled as one graph, CUDA graphs, compiled loss"] = forge_step(
                args, tokens, dtype, compile="graphs", loss_of=loss
            )
        runs["transformers compiled"] = step_fn(torch.compile(hf_model()), theirs, True, tokens, dtype)
        # kept when lean: transformers' best, as forge's compiled row has its compiled loss
        hf_compiled = torch.compile(hf_model())
        runs["transformers compiled, compiled loss"] = step_fn(hf_compiled, theirs, True, tokens, dtype, loss)
    return args, runs


def profile_step(step: Callable, top: int, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        step()
        if on_gpu:
            torch.cuda.synchronize()
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=top)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", type=parse_shape, help="dim:layers:seq:batch (repeatable)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (benchmarks/gpu.sh)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager contenders only")
    parser.add_argument("--lean", action="store_true", help="forge eager, forge compiled with compiled loss (its "
                        "parallel.compile=true), transformers eager, compiled, and compiled with the compiled loss: no "
                        "ablation rows")  # fmt: skip
    parser.add_argument("--profile", type=int, default=15, help="ops in forge's step profile (0: none)")
    parser.add_argument("--whole-model", action="store_true", help="add forge with its whole forward compiled as "
                        "one graph (parallel.compile_scope=model)")  # fmt: skip
    parser.add_argument("--cuda-graphs", action="store_true", help="add forge's per-block graphs and its whole "
                        "forward as one graph, replayed as CUDA graphs (torch.compile mode reduce-overhead; on a "
                        "GPU)")  # fmt: skip
    parser.add_argument("--profile-all", action="store_true", help="profile every contender, not forge eager alone")
    parser.add_argument("--peak-seconds", type=float, default=0.5, help="length of each peak-measuring burst")
    parser.add_argument("--host-memory", choices=("glibc", "forge"), default="glibc",
                        help="forge: every contender runs under forge-train's one-process host memory (heap kept, "
                        "huge pages; forge.runtime.host_memory)")  # fmt: skip
    opts = parser.parse_args()
    if opts.host_memory == "forge":  # before any tensor: torch reads its huge-page switch at the first allocation
        print(f"host memory: heap kept {keep_heap()}, huge pages {ask_huge_pages()}")
    shapes = opts.shape or [(256, 4, 256, 8), (1024, 4, 512, 4)]
    device = torch.device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    sync = synchronizer(device)
    threads = torch.get_num_threads()
    print(f"cpu flags: {cpu_flags()}{gpu_note(device)} | {dtype} | {threads} threads | torch {torch.__version__}")
    profiles = []
    for dim, layers, seq, batch in shapes:
        # a second shape through the same code would be compiled for dynamic shapes; a run trains on one shape
        torch._dynamo.reset()
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), device=device)
        args, runs = contenders(
            dim, layers, seq, tokens, dtype, opts.compile, opts.lean, opts.whole_model, opts.cuda_graphs
        )
        for step in runs.values():
            step()  # warm-up (and compilation)
        sync()
        widest = (batch * seq, dim, max(4 * dim, VOCAB))
        peaks, seconds = [peak_flops(device, dtype, widest, opts.peak_seconds)], {name: [] for name in runs}
        for _ in range(opts.steps):
            # a burst frees its large matrices: the step after it pays page faults the others do not (forge eager,
            # timed first, read 0.8x of the same step timed later), so an untimed step comes first
            runs["forge eager"]()
            for name, step in runs.items():
                sync()
                start = time.perf_counter()
                step()
                sync()
                seconds[name].append(time.perf_counter() - start)
            peaks.append(peak_flops(device, dtype, widest, opts.peak_seconds / 2))
        rate = {name: batch * seq / statistics.median(s) for name, s in seconds.items()}
        flops_per_token, peak = count_flops_per_token(args, seq).training, max(peaks)
        print(f"\ndim {dim}, {layers} layers, seq {seq}, batch {batch}: {dtype} matmul peak {peak / 1e9:,.1f} GFLOP/s")
        print("| contender | tokens/s | / transformers eager | / transformers compiled | MFU |")
        print("|---|---|---|---|---|")
        for name, value in rate.items():
            vs_compiled = f"{value / rate['transformers compiled']:.2f}x" if "transformers compiled" in rate else "-"
            print(
                f"| {name} | {value:,.0f} | {value / rate['transformers eager']:.2f}x | {vs_compiled} | "
                f"{100 * flops_per_token * value / peak:.0f}% |"
            )
        if opts.profile:
            for name in runs if opts.profile_all else ["forge eager"]:
                profiles.append((f"{name} step, dim {dim}", profile_step(runs[name], opts.profile, device)))
    for title, table in profiles:
        print(f"\n{title}, by self {'GPU' if device.type == 'cuda' else 'CPU'} time:\n{table}")


if __name__ == "__main__":
    main()
