import numpy as np
import pytest

from forge.config.schema import EmbeddedDataConfig, options
from forge.data.embedded import EmbeddedCorpus, read_scenes
from forge.data.sources import DataError


def test_corpus_is_shakespeare_with_held_out_scenes(corpus):
    scenes = read_scenes()
    assert len(scenes) > 700
    assert any("To be, or not to be" in s for s in scenes)
    assert corpus.vocab_size == 8192
    assert corpus.train_tokens.dtype == np.uint16
    assert len(corpus.train_tokens) > 1_000_000 and len(corpus.val_tokens) > 50_000
    assert int(corpus.train_tokens.max()) < 8192
    # documents are separated by EOS; the validation scenes are not in the training split
    assert (np.asarray(corpus.val_tokens) == corpus.eos_id).sum() == len(scenes) // 20
    text = corpus.tokenizer.decode(list(np.asarray(corpus.val_tokens[:200], dtype=np.int64)))
    assert text.strip() and text[:100] not in "".join(s for i, s in enumerate(scenes) if (i + 1) % 20)


def test_gpt2_tokenizer_from_package(tmp_path):
    from forge.data.tokenizer import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    assert tokenizer.encode("Hello world").ids == [15496, 995]
    assert tokenizer.get_vocab_size() == 50257
    assert tokenizer.decode(tokenizer.encode("Thou art a villain.").ids) == "Thou art a villain."


def test_an_unusable_cache_dir_is_named_before_any_work():
    """FORGE_CACHE_DIR (data.cache_dir) that cannot be created used to end in a FileNotFoundError traceback."""
    with pytest.raises(
        DataError, match="data.cache_dir=/proc/forge-cache: cannot use the corpus cache .*FORGE_CACHE_DIR"
    ):
        EmbeddedCorpus(**options(EmbeddedDataConfig, cache_dir="/proc/forge-cache"))
