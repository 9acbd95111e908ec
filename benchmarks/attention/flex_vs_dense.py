"""Document-masked attention at long sequence: the dense-mask SDPA path against flex attention, side by side.

    python -m benchmarks.attention.flex_vs_dense [--seqs 4096 8192] [--heads 8] [--head-dim 64] [--doc-len 512]

One attention layer of packed documents (lengths drawn around --doc-len), built as forge's model builds it: the
mask from the document ids (forge.models.common.attention: `dense_attention_mask` for SDPA, `flex_block_mask` for flex),
then `attend`. Each case runs in a fresh process, so its peak resident memory (VmHWM, reset after warm-up and
compilation) is its own; the time is the median of --reps runs, mask included. Cases:
- forward: no autograd; flex runs its compiled block-sparse kernel (CPU inference kernel of inductor).
- forward+backward: with autograd; on CPU torch 2.13 has no compiled flex backward, so flex runs its eager operator
  (forge's `_flex_reference`: the same BlockMask, unfused (batch, heads, seq, seq) scores).
Prints the CPU flags (bf16 machines differ); fp32 throughout.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout, for benchmarks.machine

from benchmarks.machine import cpu_flags  # noqa: E402

CASES = [("sdpa", False), ("flex", False), ("sdpa", True), ("flex", True)]


def vmhwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def vmrss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def document_ids(seq: int, doc_len: int, seed: int = 0):
    """(1, seq) ids of packed documents whose lengths are uniform in [doc_len / 2, 3 doc_len / 2]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(doc_len // 2, doc_len * 3 // 2 + 1, (seq // (doc_len // 2) + 1,), generator=gen)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:seq][None]


def child(kernel: str, grad: bool, seq: int, heads: int, head_dim: int, doc_len: int, reps: int) -> dict:
    import torch

    from forge.models.common.attention import DocumentMask, attend, layer_masks

    torch.manual_seed(0)
    doc_ids = document_ids(seq, doc_len)
    q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=grad) for _ in range(3))

    def run() -> None:
        with torch.set_grad_enabled(grad):
            mask = layer_masks(DocumentMask(doc_ids), [None], kernel == "flex", 1, seq, q.device)[None]
            out = attend(q, k, v, mask)
            if grad:
                out.sum().backward()

    run()  # warm-up: compilation of create_block_mask and flex, kernels
    run()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    base = vmrss_mib()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_mib": vmhwm_mib() - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("KERNEL", "GRAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kernel, grad = args.child[0], args.child[1] == "1"
        result = child(kernel, grad, args.seqs[0], args.heads, args.head_dim, args.doc_len, args.reps)
        print(json.dumps(result))
        return
    print(f"CPU flags: {cpu_flags()}; fp32, 1 sample x {args.heads} heads x {args.head_dim}, documents ~{args.doc_len}")
    print(f"{'seq':>6} {'case':<18} {'sdpa s':>8} {'flex s':>8} {'sdpa MiB':>9} {'flex MiB':>9} {'time flex/sdpa':>15}")
    for seq in args.seqs:
        for grad in (False, True):
            got = {}
            for kernel in ("sdpa", "flex"):
                cmd = [sys.executable, "-m", "benchmarks.attention.flex_vs_dense", "--seqs", str(seq)]
                cmd += ["--heads", str(args.heads), "--head-dim", str(args.head_dim), "--doc-len", str(args.doc_len)]
                cmd += ["--reps", str(args.reps), "--child", kernel, "1" if grad else "0"]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
                got[kernel] = json.loads(proc.stdout.strip().splitlines()[-1])
            case = "forward+backward" if grad else "forward"
            s, f = got["sdpa"], got["flex"]
            print(
                f"{seq:>6} {case:<18} {s['seconds']:>8.3f} {f['seconds']:>8.3f} {s['peak_mib']:>9.0f} "
                f"{f['peak_mib']:>9.0f} {f['seconds'] / s['seconds']:>14.2f}x"
            )


if __name__ == "__main__":
    main()
