"""Measure the peak RSS growth of two fp32 AdamW steps of a small decoder on the CPU and print it with the
estimate of forge.train.plan_report (bytes): `measured estimated`. Run in a fresh process (peak RSS is per process)."""

import resource
import sys

import torch
import torch.nn.functional as F

from forge.config.degrees import Degrees
from forge.model import TransformerArgs
from forge.model.transformer import build_transformer
from forge.train.plan_report import estimate_memory


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    torch.set_num_threads(1)
    batch, seq = 8, 256
    args = TransformerArgs(dim=256, n_layers=4, n_heads=4, vocab_size=8192, ffn_dim=1024, max_seq_len=seq)
    x = torch.randint(0, args.vocab_size, (batch, seq))
    warm = torch.nn.Linear(8, 8)
    F.cross_entropy(warm(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long)).backward()  # kernels, autograd
    before = rss()
    model = build_transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for _ in range(2):
        logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n = sum(p.numel() for p in model.parameters())
    mem = estimate_memory(args, Degrees(1, 1, 1, 1, 1), n, args.n_layers, True, batch, seq, 1.0, 4)
    est = mem.peak(False)
    print(f"params {n} acts_est {mem.activations / 2**20:.1f} MiB", file=sys.stderr)
    print(peak - before, int(est))


if __name__ == "__main__":
    main()
