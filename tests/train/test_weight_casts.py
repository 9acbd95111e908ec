"""Under bf16 autocast of fp32 weights (parallel.param_dtype=fp32) with gradient accumulation, each fp32 weight is
cast to bf16 once per optimizer step instead of once per micro-batch, and training follows the same curve bit for
bit: the later forwards reuse the very cast the first one made, and every backward still sums the weight's gradient
in fp32.

The casts are counted below autocast (a TorchDispatchMode sees each aten._to_copy of a parameter), in the real
Trainer on the embedded corpus. bf16 matmuls run on any CPU (emulated without AVX512-BF16), so this runs everywhere.
"""

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from forge.config import compose
from forge.metrics.memory import peak_live_tensor_bytes
from forge.models.llama import TransformerArgs, build_transformer
from forge.parallel.plan import apply_activation_checkpointing
from forge.train.losses import CrossEntropyLoss
from forge.train.precision import holds_weight_casts
from forge.train.steps import TextStep
from forge.train.trainer import Trainer
from tests.parallel.scenarios import curves
from tests.tiny import TINY_MODEL

STEPS, MICRO_BATCHES = 2, 4
BF16_ACCUMULATION = [
    *TINY_MODEL, "train.dtype=bf16", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
    f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.threads=1",
    "scheduler.warmup_steps=1", "metrics.console=quiet",
    "parallel.param_dtype=fp32",  # fp32 weights under autocast (bf16 ones are forge.train.compute_weights')
]  # fmt: skip


class ParameterCasts(TorchDispatchMode):
    """Counts the casts of each parameter to bf16 made inside the mode."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is torch.bfloat16:
            name = self.names.get(id(args[0]))
            if name is not None:
                self.counts[name] += 1
        return func(*args, **kwargs)


def train_counting_casts(run_dir: Path, hold: bool | None) -> tuple[Trainer, Counter[str], dict]:
    """Train BF16_ACCUMULATION (hold=None: as the trainer decides; else forced), counting the parameters' casts in
    the steps' forwards and backwards."""
    trainer = Trainer(compose(BF16_ACCUMULATION), run_dir)
    if hold is not None:
        trainer.step_body.hold_weight_casts = hold
    casts = ParameterCasts(trainer.model)
    forward_backward = trainer.step_body.forward_backward

    def counted(batches, loss):
        with casts:
            return forward_backward(batches, loss)

    trainer.step_body.forward_backward = counted
    trainer.fit()
    return trainer, casts.counts, curves(run_dir)


def test_each_weight_is_cast_once_per_step_and_the_curve_is_unchanged(tmp_path):
    trainer, held, held_curve = train_counting_casts(tmp_path / "held", None)
    assert trainer.holds_weight_casts and trainer.step_body.hold_weight_casts  # the default under bf16 accumulation
    _, per_forward, per_forward_curve = train_counting_casts(tmp_path / "per_forward", False)

    cast = set(per_forward)
    matrices = {name for name, p in trainer.model.named_parameters() if p.dim() == 2}
    assert cast == matrices - {"tok_embeddings.weight"}  # every linear's weight (an embedding lookup is not cast)
    assert per_forward == {name: STEPS * MICRO_BATCHES for name in cast}
    assert held == {name: STEPS for name in cast}
    assert len(held_curve["loss"]) == STEPS
    assert held_curve == per_forward_curve  # bitwise: the same casts, the same fp32 gradient sums


@pytest.mark.parametrize(
    ("dtype", "micro_batches", "sharded", "checkpointed", "holds"),
    [
        ("bf16", 4, False, False, True),
        ("fp32", 4, False, False, False),  # nothing is cast
        ("bf16", 1, False, False, False),  # one forward casts once anyway
        ("bf16", 4, True, False, False),  # FSDP frees each block's gathered weights after use
        ("bf16", 4, False, True, False),  # checkpointed blocks free their casts after the forward
    ],
)
def test_casts_are_held_only_where_the_peak_memory_has_them_anyway(dtype, micro_batches, sharded, checkpointed, holds):
    assert holds_weight_casts(dtype, micro_batches, sharded, checkpointed) is holds


def step_peaks(checkpoint: str) -> dict[bool, int]:
    """Peak live tensor bytes of a 3-micro-batch bf16 step, casts held and not, blocks checkpointed or not."""
    torch.manual_seed(0)
    args = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, max_seq_len=32)
    model = build_transformer(args, torch.device("cpu"))
    if checkpoint != "none":
        apply_activation_checkpointing(model, checkpoint)
    step = TextStep(model, torch.device("cpu"), "bf16")
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    batches = [(tokens[:, :-1], tokens[:, 1:])] * 3
    step.forward_backward(batches, CrossEntropyLoss())  # the gradients exist before the measured steps
    peaks = {}
    for hold in (False, True):
        step.hold_weight_casts = hold
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step.forward_backward(batches, CrossEntropyLoss())
        peaks[hold] = peak_live_tensor_bytes(prof)
    return peaks


def test_held_casts_add_nothing_to_the_peak_unless_the_blocks_are_checkpointed():
    plain = step_peaks("none")
    assert plain[True] <= plain[False]  # each forward ends with every cast alive (autograd keeps it for backward)
    checkpointed = step_peaks("full")
    assert checkpointed[True] > checkpointed[False]  # why the trainer does not hold them there
