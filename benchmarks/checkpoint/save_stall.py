"""Training stall of a checkpoint save: sync DCP save vs async (the step loop only waits for staging).

    .venv/bin/python benchmarks/checkpoint/save_stall.py [--dim 768 --layers 12 --vocab 32000]

Builds a Llama of >= 100M parameters with AdamW state, saves it with each mode into a temporary folder and prints
the seconds the training loop is blocked, side by side, and their ratio.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

from forge.models.llama import TransformerArgs, build_transformer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    opts = parser.parse_args()
    args = TransformerArgs(dim=opts.dim, n_layers=opts.layers, n_heads=12, vocab_size=opts.vocab, ffn_dim=4 * opts.dim)
    model = build_transformer(args)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, opts.vocab, (1, 8))).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    size_gb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=str(Path(tmp) / "sync"), no_dist=True)
        sync_s = time.perf_counter() - start

        stager = DefaultStager(StagingOptions(False, False, False, False))
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(Path(tmp) / "async"), async_stager=stager, no_dist=True)
        stall_s = time.perf_counter() - start
        future.result()
        async_total_s = time.perf_counter() - start
    print(f"model {n_params / 1e6:.0f}M parameters, ~{size_gb:.2f} GB with AdamW state")
    print("| mode | training blocked (s) | save finished after (s) |")
    print("|---|---|---|")
    print(f"| sync | {sync_s:.2f} | {sync_s:.2f} |")
    print(f"| async | {stall_s:.2f} | {async_total_s:.2f} |")
    print(f"stall ratio sync/async: {sync_s / max(stall_s, 1e-9):.1f}x")


if __name__ == "__main__":
    main()
