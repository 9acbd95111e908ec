"""Documents from local files (text, jsonl, parquet; paths or globs) or a Hugging Face `datasets` dataset.

Every source also has a fingerprint: file paths with a hash of their content, or the dataset's name, split and
(when not streaming) its `datasets` fingerprint. A prepared output records it, so a changed input is noticed.
"""

import glob
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_UNITS = ("file", "paragraph", "line")


class DataError(ValueError):
    """Bad input data or a prepared output that cannot be used; the message names the file or key."""


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by paths or globs, sorted within each pattern; a pattern that matches nothing is an error."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataError(f"input {pattern!r} matches no file")
        files.extend(Path(m).resolve() for m in matches)
    for path in files:
        if not path.name.endswith(TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES):
            raise DataError(
                f"input {path}: unknown file type (expected {', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)} or .parquet)"
            )
    return files


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _text_documents(path: Path, unit: str) -> Iterator[str]:
    text = path.read_text(encoding="utf-8")
    if unit == "file":
        parts = [text]
    elif unit == "paragraph":
        parts = text.split("\n\n")
    else:
        parts = text.splitlines()
    yield from (p for p in parts if p.strip())


def _json_documents(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not a JSON line ({err.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{number}: no text field {text_field!r} (has: {keys})")
            yield str(record[text_field])


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a broken file
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path}: no text field {text_field!r} (columns: {', '.join(columns)})")
    for batch in table.iter_batches(columns=[text_field], batch_size=4096):
        yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)


def file_documents(files: list[Path], text_field: str, text_unit: str) -> Iterator[str]:
    """Documents of the files in order: a text file by `text_unit`, a json/parquet file one per record."""
    if text_unit not in TEXT_UNITS:
        raise DataError(f"text_unit={text_unit!r} is not one of {', '.join(TEXT_UNITS)}")
    for path in files:
        if path.name.endswith(TEXT_SUFFIXES):
            yield from _text_documents(path, text_unit)
        elif path.name.endswith(JSON_SUFFIXES):
            yield from _json_documents(path, text_field)
        else:
            yield from _parquet_documents(path, text_field)


def load_hf_dataset(name: str, config: str | None, split: str, streaming: bool, text_field: str):
    """A `datasets` dataset by hub name (from the local cache when offline) or local path, checked for text_field."""
    import datasets

    local = Path(name).expanduser()
    try:
        if local.is_file():
            builder = "parquet" if local.suffix == ".parquet" else "json" if local.suffix in JSON_SUFFIXES else "text"
            ds = datasets.load_dataset(builder, data_files=str(local), split=split, streaming=streaming)
        else:
            ds = datasets.load_dataset(str(local) if local.exists() else name, config, split=split, streaming=streaming)
    except Exception as err:  # datasets raises many types (missing, offline, bad split)
        raise DataError(f"dataset={name!r} (split {split!r}) could not be loaded: {err}") from None
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataError(f"dataset={name!r}: no text field {text_field!r} (columns: {', '.join(columns)})")
    return ds


def dataset_documents(ds, text_field: str) -> Iterator[str]:
    for record in ds:
        if text_field not in record:
            raise DataError(f"dataset record has no text field {text_field!r} (has: {', '.join(record)})")
        if record[text_field] is not None:
            yield str(record[text_field])


def dataset_fingerprint(ds, name: str, config: str | None, split: str) -> dict:
    return {"dataset": name, "config": config, "split": split, "fingerprint": getattr(ds, "_fingerprint", None)}


def files_fingerprint(files: list[Path]) -> list[dict]:
    return [{"file": str(p), "bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files]
