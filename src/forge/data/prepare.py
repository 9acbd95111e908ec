"""Tokenise documents into flat token shards (the work behind `forge-prepare-data`).

The output folder is built in a hidden staging folder next to it and renamed at the end. An existing output is
reused when its recorded request (sources, tokenizer, shard size) matches, and refused, naming what differs,
when not. Tokenisation runs through `tokenizers`' `encode_batch`, which uses every core.
"""

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from forge.data import shards, sources
from forge.data.sources import DataError
from forge.data.tokenizer import MIN_BPE_VOCAB, eos_id_of, load_tokenizer, train_bpe

log = logging.getLogger("forge")


def _documents(cfg) -> tuple[Iterator[str] | None, object, dict]:
    """(a fresh document iterator factory, source fingerprint) for the configured inputs or dataset."""
    if bool(cfg.inputs) == bool(cfg.dataset):
        raise DataError("set exactly one of inputs=[files or globs] and dataset=<name or path>")
    if cfg.inputs:
        files = sources.expand_inputs(list(cfg.inputs))
        fingerprint = {"files": sources.files_fingerprint(files), "text_field": cfg.text_field, "unit": cfg.text_unit}
        return lambda: sources.file_documents(files, cfg.text_field, cfg.text_unit), fingerprint
    ds = sources.load_hf_dataset(cfg.dataset, cfg.dataset_config, cfg.split, cfg.streaming, cfg.text_field)
    fingerprint = {
        **sources.dataset_fingerprint(ds, cfg.dataset, cfg.dataset_config, cfg.split),
        "text_field": cfg.text_field,
    }
    return lambda: sources.dataset_documents(ds, cfg.text_field, cfg.dataset), fingerprint


def _tokenizer_request(cfg) -> tuple[Tokenizer | None, dict]:
    if cfg.tokenizer == "bpe":
        return None, {"train_bpe": cfg.vocab_size, "eos_token": cfg.eos_token}
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
    except (ValueError, FileNotFoundError) as err:
        raise DataError(str(err)) from None
    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
    return tokenizer, {"name": cfg.tokenizer, "sha256": digest, "eos_token": cfg.eos_token}


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    diffs = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            diffs.append(f"{prefix}{key}")
    return diffs


def _reuse(out: Path, request: dict) -> dict:
    meta = shards.read_meta(out)
    diffs = _differences(meta.get("request", {}), request)
    if diffs:
        raise DataError(
            f"out_dir={out} holds a different prepared output ({', '.join(diffs)} differ); "
            "choose another out_dir or delete it"
        )
    shards.open_shards(out, meta, verify_checksums=True)
    log.info("reusing %s: %s tokens in %d shards", out, f"{meta['tokens']:,}", len(meta["shards"]))
    return meta


def _encode_stream(tokenizer: Tokenizer, docs: Iterator[str], eos_id: int, batch_docs: int):
    """(token array with EOS after each document, number of documents) per batch of documents."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    while batch := list(islice(docs, batch_docs)):
        ids: list[int] = []
        for encoding in encode(batch, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(eos_id)
        yield np.asarray(ids, dtype=np.int64), len(batch)


def _build(cfg, staging: Path, documents, tokenizer: Tokenizer | None, request: dict) -> dict:
    if tokenizer is None:
        log.info("training a %d-token byte-level BPE on the input", cfg.vocab_size)
        tokenizer = train_bpe(documents(), cfg.vocab_size)
    try:
        eos_id = eos_id_of(tokenizer, cfg.eos_token)
    except ValueError as err:
        raise DataError(f"tokenizer={cfg.tokenizer!r}: {err}") from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = shards.token_dtype(vocab_size)
    tokenizer.save(str(staging / shards.TOKENIZER))
    writer = shards.ShardWriter(staging, dtype, cfg.shard_tokens)
    n_docs = n_tokens = 0
    start = time.perf_counter()
    with tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not cfg.progress) as bar:
        for tokens, docs in _encode_stream(tokenizer, documents(), eos_id, cfg.batch_docs):
            writer.add(tokens)
            n_docs += docs
            n_tokens += len(tokens)
            bar.update(len(tokens))
    written = writer.close()
    seconds = time.perf_counter() - start
    if n_docs == 0:
        raise DataError("the input holds no documents (empty corpus)")
    return {
        "format": shards.FORMAT_VERSION,
        "request": request,
        "tokenizer": shards.TOKENIZER,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": dtype.name,
        "tokens": n_tokens,
        "documents": n_docs,
        "shards": written,
        "seconds": round(seconds, 3),
    }


def prepare(cfg) -> tuple[dict, bool]:
    """Prepare (or reuse) the output folder `cfg.out_dir`; returns (metadata, reused)."""
    if cfg.shard_tokens < 1 or cfg.batch_docs < 1:
        raise DataError(f"shard_tokens={cfg.shard_tokens} and batch_docs={cfg.batch_docs} must be positive")
    if cfg.tokenizer == "bpe" and cfg.vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"vocab_size={cfg.vocab_size} is too small for a byte-level BPE: at least {MIN_BPE_VOCAB}")
    out = Path(cfg.out_dir).expanduser().resolve()
    documents, source_fingerprint = _documents(cfg)
    tokenizer, tokenizer_request = _tokenizer_request(cfg)
    request = {"sources": source_fingerprint, "tokenizer": tokenizer_request, "shard_tokens": cfg.shard_tokens}
    if (out / shards.META).exists():
        return _reuse(out, request), True
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(
            f"out_dir={out} exists and is not a prepared output (no {shards.META}); refusing to overwrite it"
        )
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as err:
        raise DataError(f"cannot create out_dir={out}: {err.strerror or err}") from err
    try:
        meta = _build(cfg, staging, documents, tokenizer, request)
        shards.write_json_atomic(staging / shards.META, meta)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta, False
