"""Start-up time to the first training step: forge-train against a hand-written transformers script, one run.

    .venv/bin/python benchmarks/train/startup.py [--rounds 3]

forge: `python -m forge.train model=llama_tiny train.steps=1 train.eval_batches=1`, read line by line as it runs. The
clock starts when the process is spawned and each phase ends when its log line appears: the model built and
initialised ("model ... parameters": imports, config composition and validation, corpus, model, the MFU peak), the
first evaluation ("step 0 | val loss", one batch) and the first optimizer step ("step 1/1"). The embedded corpus
and the measured peak come from their caches, which a warm-up run fills first.

transformers: a fresh `python -c` that imports torch and transformers, builds LlamaForCausalLM of the same shape,
creates AdamW and takes one step on random tokens: what a hand-rolled script spends before its first step, with
no config system, data or evaluation. The two alternate for --rounds rounds; the table shows medians.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = [
    ("model built", lambda line: " parameters |" in line),
    ("first eval", lambda line: "step 0 | val loss" in line),
    ("first step", lambda line: "step 1/1" in line),
]

HF_SCRIPT = """
import time, sys
start = float(sys.argv[1])
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
imported = time.time()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, attn_implementation="sdpa"))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
built = time.time()
tokens = torch.randint(0, 8192, (8, 257))
loss = F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
loss.backward()
optimizer.step()
done = time.time()
print(f"{imported - start} {built - start} {done - start}")
"""


def time_forge(run_dir: Path) -> dict[str, float]:
    """Seconds from spawn to each phase's log line, and to the process's exit."""
    cmd = [
        sys.executable, "-m", "forge.train", "model=llama_tiny", "train.steps=1", "train.eval_batches=1",
        "train.log_every=1", "scheduler.warmup_steps=0", "metrics.console=line", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        for name, matches in PHASES:
            if name not in seen and matches(line):
                seen[name] = time.perf_counter() - start
    if proc.wait() != 0 or len(seen) != len(PHASES):
        sys.exit(f"forge-train failed or printed unexpected lines (exit {proc.returncode}):\n{''.join(lines[-20:])}")
    seen["exit"] = time.perf_counter() - start
    return seen


def time_transformers() -> dict[str, float]:
    start = time.time()
    out = subprocess.run([sys.executable, "-c", HF_SCRIPT, str(start)], capture_output=True, text=True, check=True)
    imported, built, done = (float(x) for x in out.stdout.split()[-3:])
    return {"imports": imported, "model built": built, "first step": done, "exit": time.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        time_forge(Path(tmp) / "warmup")  # fills the corpus cache and the peak-FLOPs cache
        forge, hf = [], []
        for i in range(opts.rounds):
            forge.append(time_forge(Path(tmp) / f"run{i}"))
            hf.append(time_transformers())
    median = lambda runs, key: statistics.median(run[key] for run in runs) if key in runs[0] else None  # noqa: E731
    print(f"seconds from spawn, median of {opts.rounds} alternating rounds, model=llama_tiny")
    print("| phase ends | forge-train | transformers script |")
    print("|---|---|---|")
    show = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
    for name in ["imports"] + [name for name, _ in PHASES] + ["exit"]:
        print(f"| {name} | {show(median(forge, name))} | {show(median(hf, name))} |")
    ratio = median(forge, "first step") / median(hf, "first step")
    print(f"time to first step, forge-train / transformers script: {ratio:.2f}x")


if __name__ == "__main__":
    main()
