"""Measure the peak of live tensor bytes over two fp32 AdamW steps of a small decoder on the CPU, as torch's own
allocator reports it to the profiler, and print it with the estimate of forge.train.plan_report (bytes):
`measured estimated`. The allocator's count, unlike the process RSS, does not depend on glibc's caching, the CPU's
kernels or what else the machine runs, so it is the same on every machine."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from forge.config.degrees import Degrees
from forge.metrics.memory import peak_live_tensor_bytes
from forge.model import TransformerArgs
from forge.model.transformer import build_transformer
from forge.train.losses import cross_entropy
from forge.train.plan_report import estimate_memory


def main() -> None:
    torch.set_num_threads(1)
    batch, seq = 8, 256
    args = TransformerArgs(dim=256, n_layers=4, n_heads=4, vocab_size=8192, ffn_dim=1024, max_seq_len=seq)
    x = torch.randint(0, args.vocab_size, (batch, seq))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_transformer(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        for _ in range(2):
            cross_entropy(model(x), x).backward()  # the trainer's loss of plain logits
            opt.step()
            opt.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in model.parameters())
    # one micro-batch per step: the gradients (set to None by zero_grad) are not there when the activations peak
    mem = estimate_memory(args, Degrees(1, 1, 1, 1, 1), n, args.n_layers, True, batch, seq, 1.0, 4, grads_at_peak=False)
    print(f"params {n} acts_est {mem.activations / 2**20:.1f} MiB", file=sys.stderr)
    print(peak_live_tensor_bytes(prof), int(mem.peak(False)))


if __name__ == "__main__":
    main()
