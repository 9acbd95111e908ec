"""Training tokens/s of forge's decoder against transformers' LlamaForCausalLM, same shape and batch, one run.

    .venv/bin/python benchmarks/train/vs_transformers.py [--dim 256 --layers 4 --seq 256 --batch 8 --dtype auto]
        [--compile]

Both models take the same AdamW steps on the same random tokens; steps alternate between the two so machine noise
hits both alike. Prints tokens/s of each and the ratio. With --compile a third contender runs: forge with the
trainer's per-block torch.compile (parallel.compile=true), against the same eager transformers model.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from forge.model import TransformerArgs, build_transformer
from forge.parallel.plan import apply_compile
from forge.train.precision import autocast, resolve_dtype


def step_fn(model, logits_of, optimizer, tokens, dtype):
    def step() -> None:
        with autocast(torch.device("cpu"), dtype):
            logits = logits_of(model, tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", action="store_true", help="also time forge with per-block torch.compile")
    opts = parser.parse_args()
    dtype = resolve_dtype(opts.dtype, torch.device("cpu"))
    ffn = 4 * opts.dim
    args = TransformerArgs(
        dim=opts.dim, n_layers=opts.layers, n_heads=opts.heads, vocab_size=opts.vocab, ffn_dim=ffn, max_seq_len=opts.seq
    )
    ours = build_transformer(args)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=opts.vocab,
            hidden_size=opts.dim,
            intermediate_size=ffn,
            num_hidden_layers=opts.layers,
            num_attention_heads=opts.heads,
            max_position_embeddings=opts.seq,
            attn_implementation="sdpa",
        )
    )
    tokens = torch.randint(0, opts.vocab, (opts.batch, opts.seq + 1))
    runs = {
        "forge": step_fn(ours, lambda m, x: m(x), torch.optim.AdamW(ours.parameters(), lr=1e-4), tokens, dtype),
        "transformers": step_fn(
            hf, lambda m, x: m(x).logits, torch.optim.AdamW(hf.parameters(), lr=1e-4), tokens, dtype
        ),
    }
    if opts.compile:
        compiled = build_transformer(args)
        apply_compile(compiled)
        runs["forge compiled"] = step_fn(
            compiled, lambda m, x: m(x), torch.optim.AdamW(compiled.parameters(), lr=1e-4), tokens, dtype
        )
    for step in runs.values():
        step()  # warm-up (and compilation)
    seconds = dict.fromkeys(runs, 0.0)
    for _ in range(opts.steps):
        for name, step in runs.items():
            start = time.perf_counter()
            step()
            seconds[name] += time.perf_counter() - start
    tokens_per_step = opts.batch * opts.seq
    rate = {name: tokens_per_step * opts.steps / s for name, s in seconds.items()}
    print(
        f"dim {opts.dim}, {opts.layers} layers, seq {opts.seq}, batch {opts.batch}, {dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| trainer | tokens/s |")
    print("|---|---|")
    for name, value in rate.items():
        print(f"| {name} | {value:,.0f} |")
    for name in runs:
        if name != "transformers":
            print(f"{name} / transformers: {rate[name] / rate['transformers']:.2f}x")


if __name__ == "__main__":
    main()
