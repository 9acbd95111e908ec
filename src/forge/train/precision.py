"""Compute dtype: bf16 autocast where the hardware has fast bf16 matmuls, else fp32."""

import functools
from contextlib import nullcontext
from pathlib import Path

import torch

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX); without them bf16 GEMMs are emulated
    and run tens of times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def resolve_dtype(name: str, device: torch.device) -> str:
    """auto -> bf16 on CUDA and on CPUs with native bf16, else fp32; bf16 and fp32 are taken as given."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def autocast(device: torch.device, dtype: str):
    """The autocast context of a resolved dtype."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def holds_weight_casts(dtype: str, micro_batches: int, sharded: bool, checkpointed: bool) -> bool:
    """Whether one optimizer step casts each fp32 weight to bf16 once (`held_weight_casts`) rather than once per
    micro-batch: under bf16 with two or more micro-batches, when holding the casts adds nothing to the peak memory.
    (Where the weights are fp32 under autocast: parallel.param_dtype=fp32, or TP without FSDP. On one process the
    default computes on bf16 copies of the weights instead, forge.train.compute_weights, and casts nothing.)
    That holds when the weights are whole on the rank (not FSDP-sharded, where each block's gathered weights are
    freed after use) and the blocks are not checkpointed (their casts are then freed after the forward and made
    again in the recompute): the casts are kept for backward anyway, and each micro-batch's forward ends with all
    of them alive. That end is the step's peak unless a micro-batch's activations are smaller than the backward's
    last temporaries (the embedding's dense vocab x dim gradient); then the held casts can add up to their 2 bytes
    per parameter (dim 64, vocab 8192, 16-token micro-batches: 7.5 -> 8.5 MiB; at dim 256 and 128 tokens, equal)."""
    return dtype == "bf16" and micro_batches > 1 and not sharded and not checkpointed


def held_weight_casts(device: torch.device, hold: bool):
    """A scope around one optimizer step's micro-batches (forwards and backwards) in which autocast keeps its bf16
    casts of the fp32 weights: the first forward casts each weight, the later ones reuse the cast, and every
    backward still sums the weight's gradient in fp32. Autocast itself stays off in the scope (each forward enters
    its own): an open autocast scope only keeps the cache, which torch clears when the outermost one exits, before
    the optimizer changes the weights."""
    return torch.autocast(device.type, enabled=False) if hold else nullcontext()
