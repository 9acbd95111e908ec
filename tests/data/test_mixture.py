"""Mixtures: weights, temperature, phases, tokens per source, and exact resume at 1 and 2 data-parallel ranks."""

import numpy as np
import pytest
import torch

from forge.config.schema import MixtureDataConfig, options
from forge.data.loader import TokenWindows
from forge.data.mixture import MixtureCorpus, MixtureLoader
from forge.data.sources import DataError

SEQ = 8


def windows() -> dict[str, TokenWindows]:
    """Source `a` holds tokens 0..9999, `b` holds 20000..24999: a sample's first token tells its source."""
    return {
        "a": TokenWindows(np.arange(0, 10_000, dtype=np.uint16), SEQ),
        "b": TokenWindows(np.arange(20_000, 25_000, dtype=np.uint16), SEQ),
    }


def loader(micro=8, rank=0, size=1, **kw) -> MixtureLoader:
    args = {"weights": {"a": 3.0, "b": 1.0}, "global_batch": 16, "seed": 11, **kw}
    return MixtureLoader(windows(), micro_batch=micro, dp_rank=rank, dp_size=size, **args)


def share_of_a(batches: list[torch.Tensor]) -> float:
    firsts = torch.cat([b[:, 0] for b in batches])
    return (firsts < 20_000).float().mean().item()


def test_weights_temperature_and_phases_set_the_proportions():
    mix = loader()
    assert share_of_a([mix.next_batch()[0] for _ in range(200)]) == pytest.approx(0.75, abs=0.04)
    flat = loader(temperature=1e6)
    assert share_of_a([flat.next_batch()[0] for _ in range(200)]) == pytest.approx(0.5, abs=0.04)
    phased = loader(phases=[{"start_step": 50, "weights": {"a": 0.0}, "lr_scale": 0.25}])
    before = [phased.next_batch()[0] for _ in range(100)]  # 2 micro-batches per step: steps 0..49
    assert phased.lr_scale == 0.25 and phased.step == 50
    after = [phased.next_batch()[0] for _ in range(20)]
    assert share_of_a(before) == pytest.approx(0.75, abs=0.05) and share_of_a(after) == 0.0
    assert phased.metrics() == {f"tokens_{n}": c * SEQ for n, c in phased.seen.items()}
    assert sum(phased.metrics().values()) == 120 * 8 * SEQ


def test_samples_are_real_windows_of_their_source_without_repeats_in_an_epoch():
    mix = loader()
    firsts = torch.cat([mix.next_batch()[0][:, 0] for _ in range(100)]).tolist()
    a = [f for f in firsts if f < 20_000]
    assert all(f % SEQ == 0 for f in a) and len(set(a)) == len(a)


@pytest.mark.parametrize("size", [1, 2])
def test_resume_gives_the_batches_of_an_uninterrupted_run(size):
    phases = [{"start_step": 30, "weights": {"a": 1.0, "b": 5.0}}]
    ranks = [loader(micro=8 // size, rank=r, size=size, phases=phases) for r in range(size)]
    for _ in range(141):  # mid-step, across the phase change (step 30) and past an epoch of `b` (624 samples)
        for r in ranks:
            r.next_batch()
    states = [r.state_dict() for r in ranks]
    expected = [[r.next_batch()[0] for _ in range(40)] for r in ranks]
    resumed = [loader(micro=8 // size, rank=r, size=size, phases=phases) for r in range(size)]
    for r, state in zip(resumed, states):
        r.load_state_dict(state)
    assert states[0]["phase"] == 1 and states[0]["cursors"]["b"][0] >= 1
    for r, batches in zip(resumed, expected):
        assert all(torch.equal(r.next_batch()[0], b) for b in batches)


def test_resume_on_another_number_of_ranks_continues_the_global_stream():
    """Defined behaviour: same global batch -> the same global sample order, each rank takes its slice."""
    single = loader(micro=8)
    for _ in range(13):
        single.next_batch()
    state = single.state_dict()
    pair = [loader(micro=4, rank=r, size=2) for r in range(2)]
    for r in pair:
        r.load_state_dict(state)
    for _ in range(10):
        assert torch.equal(single.next_batch()[0], torch.cat([r.next_batch()[0] for r in pair]))
    other_batch = loader(micro=8, global_batch=32)
    with pytest.raises(ValueError, match="global batch of 16"):
        other_batch.load_state_dict(state)


def test_bad_mixture_settings_are_named():
    with pytest.raises(DataError, match=r"unknown sources \['c'\]"):
        loader(phases=[{"start_step": 5, "weights": {"c": 1.0}}])
    with pytest.raises(DataError, match="at least one positive"):
        loader(weights={"a": 0.0, "b": 0.0})


def test_mixture_corpus_of_two_prepared_outputs(tmp_path, inputs):
    from forge.data.prepare import prepare
    from tests.data.conftest import prepare_config

    for name, pattern in (("plays", "a.jsonl"), ("more", "b.parquet")):
        prepare(prepare_config(inputs=[str(inputs / pattern)], out_dir=str(tmp_path / name)))
    sources = {"plays": {"path": str(tmp_path / "plays"), "weight": None}, "more": {"path": str(tmp_path / "more")}}
    corpus = MixtureCorpus(
        **options(MixtureDataConfig, sources=sources, vocab_size=50257, val_fraction=0.05, document_masking=True)
    )
    mix = corpus.make_loader(seq_len=32, micro_batch=4, global_batch=8, seed=1)
    inputs_, labels, doc_ids = mix.next_batch()
    assert inputs_.shape == labels.shape == doc_ids.shape == (4, 32)
    plays, more = (len(c.train_tokens) for c in corpus.corpora.values())
    assert corpus.weights == {"plays": plays, "more": more}
    assert len(corpus.val_tokens) == sum(len(c.val_tokens) for c in corpus.corpora.values())

    prepare(
        prepare_config(inputs=[str(inputs / "c*.txt")], out_dir=str(tmp_path / "bpe"), tokenizer="bpe", vocab_size=300)
    )
    with pytest.raises(DataError, match="data.sources.other: data.vocab_size=50257 but .* vocabulary of 300"):
        MixtureCorpus(
            **options(
                MixtureDataConfig, sources={**sources, "other": {"path": str(tmp_path / "bpe")}}, vocab_size=50257
            )
        )
