"""A Hugging Face `datasets` dataset tokenised on the fly (in memory or streaming), for runs that skip
forge-prepare-data.

Every rank reads the same global stream of documents, tokenises it, packs it into samples of seq_len + 1 tokens
(consecutive samples share one token, as TokenWindows does) and takes its own slice of each global batch. The
position is (epoch, documents consumed, tokens carried over), identical on every rank, so a resume is exact and
a resume with a different number of data-parallel ranks continues the same global sample order. The cost is that
each rank tokenises the whole stream; use forge-prepare-data and data=memmap for large runs.

The first `val_documents` documents of the split (before any shuffle) are the validation set and are never
trained on. Epoch e reshuffles the remaining documents with seed (seed, e): a permutation for an in-memory
dataset, a `shuffle_buffer`-sized buffer for a streaming one (0 keeps the stored order).
"""

import logging
from collections.abc import Iterator

import datasets
import numpy as np
import torch

from forge.data.loader import split_sample
from forge.data.sources import DataError, dataset_documents, dataset_records, load_hf_dataset
from forge.data.token_corpus import TokenCorpus
from forge.data.tokenizer import eos_id_of, load_tokenizer

log = logging.getLogger(__name__)

TOKENIZE_CHUNK = 64
"""Documents tokenised per call of the (multi-threaded) Rust tokenizer."""


class HFDatasetCorpus(TokenCorpus):
    """A `datasets` split as a corpus: validation tokens up front, a resumable packing loader for training."""

    def __init__(
        self,
        dataset: str,
        vocab_size: int,
        tokenizer: str,
        dataset_config: str | None,
        split: str,
        text_field: str,
        streaming: bool,
        shuffle: bool,
        shuffle_buffer: int,
        val_documents: int,
        eos_token: str | None,
        document_masking: bool,
    ):
        try:
            self.tokenizer = load_tokenizer(tokenizer)
        except (ValueError, FileNotFoundError) as err:
            raise DataError(str(err)) from None
        try:
            self.eos_id = eos_id_of(self.tokenizer, eos_token)
        except ValueError as err:
            raise DataError(f"data.tokenizer={tokenizer!r}: {err} (data.eos_token)") from None
        if self.tokenizer.get_vocab_size() > vocab_size:
            raise DataError(
                f"data.vocab_size={vocab_size} but tokenizer {tokenizer!r} has {self.tokenizer.get_vocab_size()} tokens"
            )
        self.vocab_size = vocab_size
        self.dataset = load_hf_dataset(dataset, dataset_config, split, streaming, text_field)
        self.name = dataset
        self.text_field = text_field
        self.streaming = streaming
        self.shuffle = shuffle
        self.shuffle_buffer = shuffle_buffer
        self.val_documents = val_documents
        self.document_masking = document_masking
        if isinstance(self.dataset, datasets.Dataset):
            records = len(self.dataset)
        else:  # a stream has no length: one record past the validation ones shows there is training data
            records = sum(1 for _ in dataset_records(self.dataset.take(val_documents + 1), dataset))
        if val_documents >= records:
            raise DataError(
                f"dataset={dataset!r} has no training documents: data.val_documents={val_documents} holds out all "
                f"{records} records of split {split!r}; lower data.val_documents"
            )
        val = self.dataset.take(val_documents)
        val_docs = list(dataset_documents(val, text_field, dataset)) if val_documents else []
        self.val_tokens = self.encode(val_docs)
        if len(self.val_tokens) < 2:
            raise DataError(f"dataset={dataset!r}: data.val_documents={val_documents} gives no validation tokens")

    def encode(self, documents: list[str]) -> np.ndarray:
        """The documents' tokens laid end to end, each followed by EOS."""
        ids: list[int] = []
        for encoding in self.tokenizer.encode_batch(documents):
            ids.extend(encoding.ids)
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=np.int64)

    def training_documents(self, epoch: int, seed: int, skip: int) -> Iterator[str]:
        """Epoch `epoch`'s training documents in order, without the first `skip` of them."""
        ds = _skip(self.dataset, self.val_documents)
        if self.shuffle:
            shuffle_seed = int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])
            if self.streaming:
                if self.shuffle_buffer > 0:
                    ds = ds.shuffle(seed=shuffle_seed, buffer_size=self.shuffle_buffer)
            else:
                ds = ds.shuffle(seed=shuffle_seed)
        return dataset_documents(_skip(ds, skip), self.text_field, self.name)

    def make_loader(
        self, seq_len: int, micro_batch: int, global_batch: int, seed: int, dp_rank: int, dp_size: int
    ) -> "PackingLoader":
        return PackingLoader(self, seq_len, micro_batch, seed, dp_rank, dp_size, self.document_eos)


def _skip(ds, n: int):
    """`ds` without its first n records (an in-memory Dataset's skip and select fail when nothing is left)."""
    if n == 0:
        return ds
    if isinstance(ds, datasets.Dataset) and n >= len(ds):
        return []
    return ds.skip(n)


class PackingLoader:
    """Packs the corpus's tokenised training documents into batches; the state is the exact stream position."""

    lr_scale = 1.0
    """Learning-rate factor asked by the data (mixture phases); always 1 here."""

    def __init__(
        self,
        corpus: HFDatasetCorpus,
        seq_len: int,
        micro_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        document_eos: int | None = None,
    ):
        self.corpus = corpus
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.document_eos = document_eos
        self.epoch = 0
        self.documents = 0
        """Training documents of this epoch already tokenised into `self.buffer`."""
        self.buffer = np.empty(0, dtype=np.int64)
        """Tokens read but not yet consumed; the first one starts the next sample."""
        self._stream: Iterator[str] | None = None

    def _documents(self) -> Iterator[str]:
        if self._stream is None:
            self._stream = self.corpus.training_documents(self.epoch, self.seed, self.documents)
        return self._stream

    def _fill(self, needed: int) -> None:
        """Read documents until the buffer holds `needed` tokens, wrapping into the next epoch when the data ends."""
        empty_epochs = 0
        while len(self.buffer) < needed:
            chunk = [doc for _, doc in zip(range(TOKENIZE_CHUNK), self._documents(), strict=False)]
            if not chunk:
                if self.documents == 0 or empty_epochs:
                    raise DataError(f"dataset={self.corpus.name!r} has no training documents after data.val_documents")
                log.info("dataset %s: epoch %d done after %d documents", self.corpus.name, self.epoch, self.documents)
                self.epoch, self.documents, self._stream = self.epoch + 1, 0, None
                empty_epochs += 1
                continue
            empty_epochs = 0
            self.documents += len(chunk)
            self.buffer = np.concatenate([self.buffer, self.corpus.encode(chunk)])

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """(inputs, labels), each (micro_batch, seq_len) int64, plus doc_ids with document masking."""
        span = self.micro_batch * self.dp_size
        self._fill(span * self.seq_len + 1)
        first = self.dp_rank * self.micro_batch
        samples = np.stack(
            [self.buffer[i * self.seq_len : (i + 1) * self.seq_len + 1] for i in range(first, first + self.micro_batch)]
        )
        self.buffer = self.buffer[span * self.seq_len :]
        return split_sample(torch.from_numpy(samples), self.document_eos)

    def metrics(self) -> dict:
        return {"data_epoch": self.epoch}

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "documents": self.documents,
            "buffer": torch.from_numpy(self.buffer.copy()),
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this run uses {self.seed}")
        if state["seq_len"] != self.seq_len:
            raise ValueError(f"loader state was saved with seq_len {state['seq_len']}, this run uses {self.seq_len}")
        self.epoch, self.documents = int(state["epoch"]), int(state["documents"])
        self.buffer = np.asarray(state["buffer"].numpy(), dtype=np.int64)
        self._stream = None
