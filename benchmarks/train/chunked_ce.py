"""Peak memory and training tokens/s of plain against chunked cross-entropy (conf/loss), side by side.

    .venv/bin/python benchmarks/train/chunked_ce.py [--vocab 32000 --dim 256 --layers 4 --seq 256 --batch 8
                                                     --chunk 512 --dtype auto --rounds 2 --device cpu]

Each measurement runs in a fresh process (so the CPU's peak resident set belongs to that loss alone): build the
model and AdamW, take a warm-up step, then time `--steps` steps. Plain and chunked alternate for `--rounds` rounds
so machine noise hits both alike; the table shows the mean. Memory is the step's peak above what the process held
before its first step (model, batch): resident set on a CPU, allocated memory on CUDA.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from forge.models.llama import TransformerArgs, build_transformer
from forge.train.losses import ChunkedCrossEntropyLoss, CrossEntropyLoss
from forge.train.precision import autocast, resolve_dtype

GIB = 2**30


def rss_bytes() -> int:
    """Current resident set size (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(opts) -> dict:
    """One loss's peak memory and tokens/s, in this process."""
    device = torch.device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    args = TransformerArgs(
        dim=opts.dim,
        n_layers=opts.layers,
        n_heads=opts.heads,
        vocab_size=opts.vocab,
        ffn_dim=4 * opts.dim,
        max_seq_len=opts.seq,
    )
    model = build_transformer(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = ChunkedCrossEntropyLoss(opts.chunk) if opts.loss == "chunked" else CrossEntropyLoss()
    tokens = torch.randint(0, opts.vocab, (opts.batch, opts.seq + 1), device=device)

    def step() -> None:
        with autocast(device, dtype):
            loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else rss_bytes()
    step()  # warm-up; AdamW's state is allocated here, in both runs alike
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(opts.steps):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "tokens_per_s": opts.batch * opts.seq * opts.steps / seconds,
        "peak_gib": (peak - base) / GIB,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512, help="tokens per chunk of the chunked loss")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--loss", choices=["plain", "chunked"], help=argparse.SUPPRESS)  # set in the child
    opts = parser.parse_args()
    if opts.loss:
        print(json.dumps(measure(opts)))
        return
    results: dict[str, list[dict]] = {"plain": [], "chunked": []}
    for _ in range(opts.rounds):
        for loss in results:
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--loss", loss],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[loss].append(json.loads(out.strip().splitlines()[-1]))
    rate = {k: statistics.mean(r["tokens_per_s"] for r in v) for k, v in results.items()}
    peak = {k: statistics.mean(r["peak_gib"] for r in v) for k, v in results.items()}
    first = results["plain"][0]
    memory = "peak allocated" if opts.device.startswith("cuda") else "peak RSS"
    print(
        f"vocab {opts.vocab}, dim {opts.dim}, {opts.layers} layers, seq {opts.seq}, batch {opts.batch} "
        f"({opts.batch * opts.seq} tokens/step), chunk {opts.chunk}, {first['dtype']}, {first['threads']} threads, "
        f"{opts.device}, mean of {opts.rounds} rounds"
    )
    print(f"| loss | tokens/s | {memory} above start (GiB) |")
    print("|---|---|---|")
    for name in results:
        print(f"| {name} | {rate[name]:,.0f} | {peak[name]:.3f} |")
    print(
        f"chunked / plain: tokens/s {rate['chunked'] / rate['plain']:.2f}x, "
        f"memory {peak['chunked'] / peak['plain']:.2f}x"
    )


if __name__ == "__main__":
    main()
