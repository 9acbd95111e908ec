"""A weighted mixture of prepared sources with phases, and its resumable data-parallel loader.

The sample stream is global: sample n (counted over all ranks) comes from the source picked by a uniform draw
seeded by (seed, n // BLOCK) against the probabilities of the phase of step n // global_batch. Each source
walks its own seeded per-epoch permutation. The state (samples drawn, each source's epoch and cursor, tokens
per source) is all there is, so a resumed run sees the same batches, at any number of data-parallel ranks as
long as the global batch is unchanged.
"""

import zlib

import numpy as np
import torch

from forge.data.loader import TokenWindows, split_sample
from forge.data.memmap import MemmapCorpus, TokenSpan
from forge.data.order import EpochOrder
from forge.data.sources import DataError
from forge.data.token_corpus import TokenCorpus

BLOCK = 4096


def _tempered(weights: dict[str, float], temperature: float) -> dict[str, float]:
    raised = {name: w ** (1.0 / temperature) for name, w in weights.items()}
    total = sum(raised.values())
    return {name: w / total for name, w in raised.items()}


class MixtureLoader:
    """Batches whose samples are drawn from several sources by weight; phases change weights and lr scale."""

    def __init__(
        self,
        windows: dict[str, TokenWindows],
        weights: dict[str, float],
        micro_batch: int,
        global_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        temperature: float = 1.0,
        phases: list[dict] | None = None,
        document_eos: int | None = None,
    ):
        if temperature <= 0:
            raise DataError(f"data.temperature={temperature} must be positive")
        if global_batch % (micro_batch * dp_size):
            raise DataError(f"global batch {global_batch} is not a multiple of {micro_batch} x {dp_size} ranks")
        self.names = list(windows)
        self.windows = windows
        self.micro_batch, self.global_batch = micro_batch, global_batch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.document_eos = document_eos
        self.phases = [self._phase(0, weights, 1.0, temperature)]
        for phase in sorted(phases or [], key=lambda p: p["start_step"]):
            merged = {**weights, **phase.get("weights", {})}
            self.phases.append(self._phase(phase["start_step"], merged, phase.get("lr_scale", 1.0), temperature))
        self.samples = 0
        self.orders = {
            name: EpochOrder(len(self.windows[name]), [seed, zlib.crc32(name.encode())]) for name in self.names
        }
        self.seen = dict.fromkeys(self.names, 0)
        self._block: tuple[int, np.ndarray] | None = None

    def _phase(self, start: int, weights: dict[str, float], lr_scale: float, temperature: float) -> dict:
        unknown = set(weights) - set(self.names)
        if unknown:
            raise DataError(f"data.phases weights name unknown sources {sorted(unknown)} (sources: {self.names})")
        if any(weights[n] < 0 for n in self.names) or not any(weights[n] > 0 for n in self.names):
            raise DataError(f"mixture weights {dict(weights)} must be >= 0 with at least one positive")
        probs = _tempered({n: float(weights[n]) for n in self.names}, temperature)
        return {"start_step": start, "cdf": np.cumsum([probs[n] for n in self.names]), "lr_scale": lr_scale}

    @property
    def step(self) -> int:
        """Optimizer steps the drawn samples amount to."""
        return self.samples // self.global_batch

    def _phase_at(self, step: int) -> dict:
        return [p for p in self.phases if p["start_step"] <= step][-1]

    @property
    def lr_scale(self) -> float:
        return float(self._phase_at(self.step)["lr_scale"])

    def _uniform(self, n: int) -> float:
        if self._block is None or self._block[0] != n // BLOCK:
            self._block = (n // BLOCK, np.random.default_rng([self.seed, n // BLOCK]).random(BLOCK))
        return float(self._block[1][n % BLOCK])

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """This rank's slice of the next micro_batch * dp_size global samples."""
        span = self.micro_batch * self.dp_size
        mine = range(self.dp_rank * self.micro_batch, (self.dp_rank + 1) * self.micro_batch)
        rows = []
        for offset in range(span):
            n = self.samples + offset
            cdf = self._phase_at(n // self.global_batch)["cdf"]
            source = self.names[min(int(np.searchsorted(cdf, self._uniform(n), side="right")), len(self.names) - 1)]
            index = self.orders[source].next_index()
            self.seen[source] += 1
            if offset in mine:
                rows.append(self.windows[source][index])
        self.samples += span
        return split_sample(torch.from_numpy(np.stack(rows)), self.document_eos)

    def metrics(self) -> dict:
        """Tokens drawn so far from each source (over all ranks), for the training log."""
        seq_len = next(iter(self.windows.values())).seq_len
        return {f"tokens_{name}": count * seq_len for name, count in self.seen.items()}

    def state_dict(self) -> dict:
        return {
            "samples": self.samples,
            "cursors": {n: [o.epoch, o.cursor] for n, o in self.orders.items()},
            "seen": dict(self.seen),
            "seed": self.seed,
            "global_batch": self.global_batch,
            "phase": self.phases.index(self._phase_at(self.step)),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this run uses {self.seed}")
        if state["global_batch"] != self.global_batch:
            raise ValueError(
                f"loader state was saved with a global batch of {state['global_batch']}, this run uses "
                f"{self.global_batch}; mixture phases count steps in global batches, so it must not change"
            )
        if sorted(state["cursors"]) != sorted(self.names):
            raise ValueError(f"loader state has sources {sorted(state['cursors'])}, this run has {sorted(self.names)}")
        self.samples = int(state["samples"])
        for name, (epoch, cursor) in state["cursors"].items():
            self.orders[name].seek(epoch, cursor)
        self.seen = {n: int(v) for n, v in state["seen"].items()}


class MixtureCorpus(TokenCorpus):
    """Several prepared outputs (same tokenizer) mixed by weight; validation is all sources' held-out tails."""

    def __init__(
        self,
        sources: dict,
        vocab_size: int,
        temperature: float,
        phases: list | None,
        val_fraction: float,
        document_masking: bool,
    ):
        if not sources:
            raise DataError("data.sources is empty")
        self.corpora = {name: self._open(name, src, vocab_size, val_fraction) for name, src in sources.items()}
        first_name, first = next(iter(self.corpora.items()))
        for name, corpus in self.corpora.items():
            if corpus.tokenizer.to_str() != first.tokenizer.to_str() or corpus.eos_id != first.eos_id:
                raise DataError(f"data.sources.{name} was tokenised differently from data.sources.{first_name}")
        self.weights = {
            name: float(len(self.corpora[name].train_tokens) if src.get("weight") is None else src["weight"])
            for name, src in sources.items()
        }
        self.temperature = temperature
        self.phases = [dict(p) for p in phases or []]
        for phase in self.phases:
            phase["weights"] = dict(phase.get("weights") or {})
        self.train_tokens = TokenSpan([v for c in self.corpora.values() for v in c.train_tokens.pieces()])
        self.val_tokens = TokenSpan([v for c in self.corpora.values() for v in c.val_tokens.pieces()])
        self.tokenizer, self.eos_id, self.vocab_size = first.tokenizer, first.eos_id, vocab_size
        self.document_masking = document_masking
        self.val_fraction = val_fraction

    @staticmethod
    def _open(name: str, source, vocab_size: int, val_fraction: float) -> MemmapCorpus:
        try:
            return MemmapCorpus(
                source["path"], vocab_size, val_fraction, document_masking=False, verify_checksums=False
            )
        except DataError as err:
            raise DataError(f"data.sources.{name}: {err}") from None

    def make_loader(
        self, seq_len: int, micro_batch: int, global_batch: int, seed: int, dp_rank: int = 0, dp_size: int = 1
    ) -> MixtureLoader:
        windows = {name: TokenWindows(c.train_tokens, seq_len) for name, c in self.corpora.items()}
        return MixtureLoader(
            windows,
            self.weights,
            micro_batch,
            global_batch,
            seed,
            dp_rank,
            dp_size,
            self.temperature,
            self.phases,
            self.document_eos,
        )
