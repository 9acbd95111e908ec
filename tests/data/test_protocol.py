"""Every corpus is a `forge.data.Corpus` and every loader a `forge.data.Loader`: the trainer asks nothing else of the
data, so each must have all of the protocol's members; a text corpus's loader and validation batches are the
BatchLoader and eval_batches of its token splits."""

import numpy as np
import pytest
import torch

from forge.data import Corpus, Loader
from forge.data.embedded import EmbeddedCorpus
from forge.data.hf_stream import HFDatasetCorpus, PackingLoader
from forge.data.loader import BatchLoader, TokenWindows, eval_batches
from forge.data.memmap import MemmapCorpus
from forge.data.mixture import MixtureCorpus, MixtureLoader
from forge.data.sources import DataError
from forge.data.token_corpus import TokenCorpus
from forge.data.vlm.dataset import VLMCorpus, VLMLoader


def members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_the_protocols_are_small():
    assert members(Corpus) == {"make_loader", "val_batches"}
    assert members(Loader) == {"lr_scale", "next_batch", "metrics", "state_dict", "load_state_dict"}


@pytest.mark.parametrize("corpus", [EmbeddedCorpus, MemmapCorpus, MixtureCorpus, HFDatasetCorpus, VLMCorpus])
def test_every_corpus_has_the_corpus_members(corpus):
    assert all(callable(getattr(corpus, name, None)) for name in members(Corpus))


@pytest.mark.parametrize("loader", [BatchLoader, MixtureLoader, PackingLoader, VLMLoader])
def test_every_loader_has_the_loader_members(loader):
    assert all(hasattr(loader, name) for name in members(Loader))


class Tokens(TokenCorpus):
    def __init__(self, tokens: np.ndarray, document_masking: bool = False, val_fraction: float | None = None):
        self.train_tokens, self.val_tokens = tokens[:800], tokens[800:]
        self.vocab_size, self.eos_id, self.document_masking = 64, 0, document_masking
        self.val_fraction = val_fraction


@pytest.mark.parametrize("masking", [False, True])
def test_a_token_corpus_loads_its_splits_as_the_batch_loader_and_eval_batches_do(masking):
    tokens = np.random.default_rng(0).integers(0, 64, 1000).astype(np.uint16)
    corpus = Tokens(tokens, document_masking=masking)
    eos = 0 if masking else None
    loader = corpus.make_loader(8, 2, 8, 5, 1, 2)
    reference = BatchLoader(TokenWindows(tokens[:800], 8), 2, 5, 1, 2, eos, global_batch=8)
    for _ in range(30):
        for got, want in zip(loader.next_batch(), reference.next_batch(), strict=True):
            assert torch.equal(got, want)
    assert loader.state_dict() == reference.state_dict()
    val = list(corpus.val_batches(8, 2, 3, 1, 2))
    want = list(eval_batches(TokenWindows(tokens[800:], 8), 2, 3, 1, 2, eos))
    assert len(val) == len(want) and all(torch.equal(a, b) for v, w in zip(val, want) for a, b in zip(v, w))


def test_a_split_too_short_is_named_when_its_batches_are_asked_for():
    corpus = Tokens(np.zeros(820, dtype=np.uint16), val_fraction=0.02)
    with pytest.raises(DataError, match=r"the validation split \(data.val_fraction=0.02\) is too short .* larger"):
        corpus.val_batches(64, 2, 3, 0, 1)
