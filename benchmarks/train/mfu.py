"""Model FLOPs utilisation of forge's training step against the matmul peak measured on this machine, in one run.

    .venv/bin/python benchmarks/train/mfu.py [--shape 256:4:256:8 --shape 1024:4:512:4 --dtype auto --compile
                                              --steps 4 --device cpu]

A shape is dim:layers:seq:batch (heads = dim / 64, vocab 8192, SwiGLU hidden 4 x dim). For each shape the step is
AdamW on random tokens, as in the trainer's one-process step (autocast in the resolved dtype, forge's row-wise fp32
cross-entropy, fused AdamW, under bf16 one bf16 copy of the weights per step: forge.train.compute_weights). FLOPs
per token come from forge.planning.flops, the count the trainer's MFU uses (matmuls only, full seq x seq attention).

The peak is the best of square matmuls of 1024, 2048 and 4096 and of the model's own widest matmul, measured in
bursts before and between the timed steps and taking the quietest burst: the machine's rate when nothing else
runs. The steps' time is summed over all of them, so load from other jobs lowers the MFU, never raises it.
Both the peak of the dtype the step runs in and the bf16 peak are printed: on a CPU without native bf16 (no
AVX512-BF16 or AMX) the bf16 figure shows why `train.dtype=auto` trains in fp32 there.
"""

import argparse
import time

import torch

from forge.models.llama import TransformerArgs, build_transformer
from forge.parallel.plan import apply_compile
from forge.planning.flops import count_flops_per_token
from forge.planning.peak import measure_matmul_flops
from forge.train.compute_weights import ComputeWeights, scope
from forge.train.losses import cross_entropy
from forge.train.precision import autocast, resolve_dtype


def parse_shape(text: str) -> tuple[int, int, int, int]:
    dim, layers, seq, batch = (int(part) for part in text.split(":"))
    return dim, layers, seq, batch


def shape_args(dim: int, layers: int, seq: int, vocab: int) -> TransformerArgs:
    """The model of a benchmark shape: heads = dim / 64, SwiGLU hidden 4 x dim."""
    return TransformerArgs(
        dim=dim, n_layers=layers, n_heads=max(1, dim // 64), vocab_size=vocab, ffn_dim=4 * dim, max_seq_len=seq
    )


def rectangular_matmul_flops(m: int, k: int, n: int, device: torch.device, dtype: str, seconds: float) -> float:
    """FLOP/s of (m x k) @ (k x n), best of timed bursts: the model's own widest matmul shape."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a = torch.randn(m, k, device=device, dtype=torch_dtype)
    b = torch.randn(k, n, device=device, dtype=torch_dtype)
    a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * m * k * n / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, dtype: str, widest: tuple[int, int, int], seconds: float) -> float:
    squares = [measure_matmul_flops(device, dtype, size, seconds) for size in (1024, 2048, 4096)]
    return max(*squares, rectangular_matmul_flops(*widest, device, dtype, seconds))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", type=parse_shape, help="dim:layers:seq:batch (repeatable)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="per-block torch.compile, as parallel.compile=true")
    parser.add_argument("--peak-seconds", type=float, default=0.5, help="length of each peak-measuring burst")
    opts = parser.parse_args()
    shapes = opts.shape or [(256, 4, 256, 8), (1024, 4, 512, 4)]
    device = torch.device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # The bf16 peak is measured once at 512: emulated bf16 on an old CPU takes seconds per larger product.
    bf16_peak = measure_matmul_flops(device, "bf16", 512, opts.peak_seconds)

    print(f"{opts.device}, {dtype}, {torch.get_num_threads()} threads, compile={opts.compile}")
    print(f"bf16 square-matmul peak: {bf16_peak / 1e9:,.1f} GFLOP/s")
    print(f"| shape (dim, layers, seq, batch) | tokens/s | model GFLOP/s | {dtype} matmul peak GFLOP/s | MFU |")
    print("|---|---|---|---|---|")
    for dim, layers, seq, batch in shapes:
        # a second shape through the same code would be compiled for dynamic shapes; a run trains on one shape
        torch._dynamo.reset()
        args = shape_args(dim, layers, seq, opts.vocab)
        model = build_transformer(args, device)
        weights = ComputeWeights(model) if dtype == "bf16" else None
        if opts.compile:
            apply_compile(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, opts.vocab, (batch, seq + 1), device=device)

        def step() -> None:
            with scope(weights):  # noqa: B023 - called inside this iteration only
                with autocast(device, dtype):
                    logits = model(tokens[:, :-1])  # noqa: B023
                loss = cross_entropy(logits, tokens[:, 1:])  # noqa: B023
                loss.backward()
            optimizer.step()  # noqa: B023
            optimizer.zero_grad(set_to_none=True)  # noqa: B023

        step()  # warm-up (and compilation)
        widest = (batch * seq, dim, max(4 * dim, opts.vocab))
        peaks, elapsed = [peak_flops(device, dtype, widest, opts.peak_seconds)], 0.0
        for _ in range(opts.steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            elapsed += time.perf_counter() - start
            peaks.append(peak_flops(device, dtype, widest, opts.peak_seconds / 2))
        tokens_per_s = batch * seq * opts.steps / elapsed
        achieved = count_flops_per_token(args, seq).training * tokens_per_s
        peak = max(peaks)
        print(
            f"| {dim}, {layers}, {seq}, {batch} | {tokens_per_s:,.0f} | {achieved / 1e9:,.1f} | {peak / 1e9:,.1f} | "
            f"{100 * achieved / peak:.0f}% |"
        )


if __name__ == "__main__":
    main()
