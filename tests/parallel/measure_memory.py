"""Measure the peak of live tensor bytes over two AdamW steps of a small decoder on the CPU, as torch's own
allocator reports it to the profiler, and print it with the estimate of forge.planning.report (bytes):
`measured estimated`. `python measure_memory.py [fp32|bf16]`: bf16 runs the trainer's one-process bf16 step (one
bf16 copy of the weights, autocast; forge.train.compute_weights); bf16 kernels are emulated where the CPU lacks
them, which changes the time, not the tensors. The allocator's count, unlike the process RSS, does not depend on
glibc's caching, the CPU's kernels or what else the machine runs, so it is the same on every machine."""

import contextlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from forge.config.degrees import Degrees
from forge.metrics.memory import peak_live_tensor_bytes
from forge.models.llama import TransformerArgs
from forge.models.llama.transformer import build_transformer
from forge.planning.memory import estimate_memory
from forge.train.compute_weights import ComputeWeights
from forge.train.losses import cross_entropy
from forge.train.precision import autocast


def main() -> None:
    torch.set_num_threads(1)
    batch, seq = 8, 256
    args = TransformerArgs(dim=256, n_layers=4, n_heads=4, vocab_size=8192, ffn_dim=1024, max_seq_len=seq)
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    x = torch.randint(0, args.vocab_size, (batch, seq))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_transformer(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        weights = ComputeWeights(model) if dtype == "bf16" else contextlib.nullcontext()
        for _ in range(2):
            with weights:
                with autocast(torch.device("cpu"), dtype):
                    loss = cross_entropy(model(x), x)  # the trainer's loss of plain logits
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in model.parameters())
    # one micro-batch per step: the gradients (set to None by zero_grad) are not there when the activations peak
    act_bytes = 2 if dtype == "bf16" else 4
    mem = estimate_memory(
        args, Degrees(1, 1, 1, 1, 1), n, args.n_layers, True, batch, seq, 1.0, act_bytes, grads_at_peak=False
    )
    # torch's rms_norm on a CPU is a composite whose backward keeps the fp32 normalized input as well (4 bytes per
    # token per norm: 2 per block and the final one); the accelerators' fused kernel keeps only its input and a
    # statistic, which is what the estimate counts
    cpu_norms = 4 * args.dim * batch * seq * (2 * args.n_layers + 1)
    print(f"params {n} acts_est {mem.activations / 2**20:.1f} MiB", file=sys.stderr)
    print(peak_live_tensor_bytes(prof), int(mem.peak(False) + cpu_norms))


if __name__ == "__main__":
    main()
