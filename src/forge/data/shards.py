"""Flat token shards on disk: `shard_00000.npy`... with EOS between documents, `meta.json` and `tokenizer.json`.

Every file is written under a temporary name and renamed, and a whole output is built in a staging folder that is
renamed at the end, so a folder with a `meta.json` is always complete. The metadata records each shard's token
count and sha256, which `open_shards` checks.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from forge.data.sources import DataError
from forge.files import temp_file

META = "meta.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def write_json_atomic(path: Path, obj) -> None:
    fd, tmp = temp_file(path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _array_digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8)).hexdigest()[:16]


class ShardWriter:
    """Appends token chunks and writes a shard each time `shard_tokens` tokens are buffered."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int):
        self.folder = folder
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._chunks: list[np.ndarray] = []
        self._buffered = 0

    def add(self, tokens: np.ndarray) -> None:
        self._chunks.append(tokens.astype(self.dtype, copy=False))
        self._buffered += len(tokens)
        while self._buffered >= self.shard_tokens:
            flat = np.concatenate(self._chunks)
            self._write(flat[: self.shard_tokens])
            rest = flat[self.shard_tokens :]
            self._chunks, self._buffered = [rest], len(rest)

    def close(self) -> list[dict]:
        if self._buffered:
            self._write(np.concatenate(self._chunks))
        self._chunks, self._buffered = [], 0
        return self.shards

    def _write(self, tokens: np.ndarray) -> None:
        name = f"shard_{len(self.shards):05d}.npy"
        fd, tmp = temp_file(self.folder, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, tokens)
        os.replace(tmp, self.folder / name)
        self.shards.append({"file": name, "tokens": int(len(tokens)), "sha256": _array_digest(tokens)})


def read_meta(folder: Path) -> dict:
    path = folder / META
    if not path.is_file():
        raise DataError(f"{folder} is not a prepared output (no {META}); run forge-prepare-data")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err.msg})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise DataError(f"{path} has format {meta.get('format')!r}, this version reads {FORMAT_VERSION}")
    return meta


def open_shards(folder: Path, meta: dict, verify_checksums: bool = False) -> list[np.ndarray]:
    """Memory-mapped shards, checked against the metadata (presence, dtype, length; sha256 when asked)."""
    arrays = []
    for shard in meta["shards"]:
        path = folder / shard["file"]
        try:
            array = np.load(path, mmap_mode="r")
        except FileNotFoundError:
            raise DataError(f"shard {path} listed in {META} is missing") from None
        except ValueError as err:
            raise DataError(f"shard {path} is corrupt ({err})") from None
        if array.dtype != np.dtype(meta["dtype"]) or array.ndim != 1 or len(array) != shard["tokens"]:
            raise DataError(
                f"shard {path} is corrupt: {array.dtype}[{len(array)}], {META} says {meta['dtype']}[{shard['tokens']}]"
            )
        if verify_checksums and _array_digest(array) != shard["sha256"]:
            raise DataError(f"shard {path} is corrupt: its sha256 does not match {META}")
        arrays.append(array)
    return arrays
