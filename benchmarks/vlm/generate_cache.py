"""VLM generation with and without the KV cache, side by side:

    python benchmarks/vlm/generate_cache.py [--frames 8 --new-tokens 48 --dim 256 --layers 4 --rounds 3]

A joint decoder, an MoT and a cross-attention model (seeded random weights, the tiny local CLIP tower, mlp
connector: 16 visual tokens per 64x64 frame) answer a 16-token prompt about a clip of `frames` frames, greedily.
With the cache, the clip and prompt run once and each new token reads the keys and values of everything before
it; without, each new token recomputes the whole sequence. The rounds alternate the two, and the last column
counts the positions where both generated the same token (all of them, unless a near-tie of the random model's
logits flips on rounding).
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from forge.config.schema import options
from forge.models.llama.args import TransformerArgs
from forge.models.vlm import CrossAttentionVLM, JointDecoderVLM, MoTVLM
from forge.models.vlm.args import CrossAttentionVLMConfig, VLMConfig
from forge.models.vlm.base import VLMCache
from forge.models.vlm.encoder import build_tiny_encoder
from forge.parallel.init import materialize_sharded

STRATEGIES = {"joint_decoder": JointDecoderVLM, "mot": MoTVLM, "cross_attention": CrossAttentionVLM}
SCHEMAS = {JointDecoderVLM: VLMConfig, MoTVLM: VLMConfig, CrossAttentionVLM: CrossAttentionVLMConfig}


@torch.no_grad()
def greedy(model, prompt, pixels, mask, times, new_tokens: int, use_cache: bool) -> list[int]:
    out: list[int] = []
    cache = VLMCache()
    for _ in range(new_tokens):
        if not use_cache:
            logits = model(torch.cat([prompt, torch.tensor([out], dtype=torch.long)], dim=1), pixels, mask, times)
        elif not out:
            logits = model.prefill(prompt, pixels, mask, times, cache)
        else:
            logits = model.decode(torch.tensor([out[-1:]]), cache)
        out.append(int(logits[0, -1].argmax()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    text = TransformerArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.dim // 64,
        vocab_size=8192,
        ffn_dim=4 * args.dim,
        max_seq_len=1024,
    )
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(1, args.frames, 3, 64, 64, generator=gen)
    mask = torch.ones(1, args.frames, dtype=torch.bool)
    times = torch.arange(args.frames, dtype=torch.float32)[None] * 0.5
    prompt = torch.randint(0, 8192, (1, 16), generator=gen)
    print(f"{args.frames} frames, 16-token prompt, {args.new_tokens} new tokens, dim {args.dim}, {args.layers} layers")
    print(f"{'strategy':<16} {'cached tok/s':>12} {'recomputed tok/s':>17} {'speed-up':>9}   check")
    with tempfile.TemporaryDirectory() as tmp:
        encoder = str(build_tiny_encoder(Path(tmp) / "clip"))
        for name, cls in STRATEGIES.items():
            with torch.device("meta"):  # as training builds it: everything but the loaded tower, then filled
                model = cls(text, **options(SCHEMAS[cls], encoder_path=encoder))
            materialize_sharded(model, model, 0, torch.device("cpu"))
            model.eval()
            if name == "cross_attention":  # open the gates so the clip matters
                for block in model.cross_layers.values():
                    block.attn_gate.data.fill_(1.0)
            seconds = {True: 0.0, False: 0.0}
            outputs = {}
            for _ in range(args.rounds):
                for use_cache in (True, False):
                    start = time.perf_counter()
                    outputs[use_cache] = greedy(model, prompt, pixels, mask, times, args.new_tokens, use_cache)
                    seconds[use_cache] += time.perf_counter() - start
            same = sum(a == b for a, b in zip(outputs[True], outputs[False], strict=True))
            rate = {k: args.rounds * args.new_tokens / v for k, v in seconds.items()}
            print(
                f"{name:<16} {rate[True]:>12.1f} {rate[False]:>17.1f} {rate[True] / rate[False]:>8.2f}x"
                f"   same tokens {same}/{args.new_tokens}"
            )


if __name__ == "__main__":
    main()
