"""Documents from local files (text, jsonl, parquet; paths or globs) or a Hugging Face `datasets` dataset.

Every source also has a fingerprint: file paths with a hash of their content, or the dataset's name, split and
(when not streaming) its `datasets` fingerprint. A prepared output records it, so a changed input is noticed.
"""

import glob
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_UNITS = ("file", "paragraph", "line")

log = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad input data or a prepared output that cannot be used; the message names the file or key."""


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by paths or globs, sorted within each pattern; a pattern that matches nothing is an error.
    A file named more than once (twice in the list, by overlapping globs, or through a symlink loop that `**`
    walks round) is read once, at its first place, with one warning."""
    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataError(f"input {pattern!r} matches no file")
        found.extend(Path(m).resolve() for m in matches)
    files = list(dict.fromkeys(found))
    repeats = {path: n for path, n in Counter(found).items() if n > 1}
    if repeats:
        named = ", ".join(f"{path} ({n} times)" for path, n in list(repeats.items())[:3])
        more = f" and {len(repeats) - 3} more" if len(repeats) > 3 else ""
        log.warning("inputs name %d file(s) more than once, each is read once: %s%s", len(repeats), named, more)
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


def not_utf8(path: Path, line: int, offset: int, byte: int) -> DataError:
    return DataError(f"{path}:{line}: not valid UTF-8 (byte 0x{byte:02x} at byte {offset} of the line)")


def _decode_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of a UTF-8 file; a line that does not decode is a DataError naming it."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise not_utf8(path, number, err.start + 1, raw[err.start]) from None


def _text_documents(path: Path, unit: str) -> Iterator[str]:
    text = "".join(line for _, line in _decode_lines(path)).replace("\r\n", "\n").replace("\r", "\n")
    if unit == "file":
        parts = [text]
    elif unit == "paragraph":
        parts = text.split("\n\n")
    else:
        parts = text.splitlines()
    yield from (p for p in parts if p.strip())


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words (for a message about a field that should hold text)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else type(value).__name__


def _json_documents(path: Path, text_field: str) -> Iterator[str]:
    for number, line in _decode_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not a JSON line ({err.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{number}: no text field {text_field!r} (has: {keys})")
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(f"{path}:{number}: text field {text_field!r} is {json_kind(text)}, not a string")
        yield text


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
        if _decode_error(err) is not None:
            raise _locate_bad_utf8(name) from None
        raise DataError(f"dataset={name!r} (split {split!r}) could not be loaded: {err}") from None
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise DataError(f"dataset={name!r}: no text field {text_field!r} (columns: {', '.join(columns)})")
    return ds


def _decode_error(err: BaseException | None) -> UnicodeDecodeError | None:
    """The UnicodeDecodeError behind `err` (`datasets` wraps some in its own errors), if any."""
    while err is not None and not isinstance(err, UnicodeDecodeError):
        err = err.__cause__ or err.__context__
    return err


def _locate_bad_utf8(name: str) -> DataError:
    """A DataError naming the first line that is not UTF-8 in a local dataset file or folder (the decode error
    that `datasets` raises names neither); only the dataset for a hub dataset."""
    local = Path(name).expanduser()
    files = [local] if local.is_file() else sorted(local.rglob("*")) if local.is_dir() else []
    for path in files:
        if path.is_file() and path.name.endswith(TEXT_SUFFIXES + JSON_SUFFIXES):
            for _ in _decode_lines(path):  # raises the DataError naming the first line that does not decode
                pass
    return DataError(f"dataset={name!r}: a record is not valid UTF-8")


def dataset_records(ds, name: str) -> Iterator[dict]:
    """The records of a `datasets` dataset; one whose text does not decode is a DataError naming file and line."""
    records = iter(ds)
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except Exception as err:  # `datasets` decodes while iterating; any other failure is its own
            if _decode_error(err) is None:
                raise
            raise _locate_bad_utf8(name) from None
        yield record


def dataset_documents(ds, text_field: str, name: str) -> Iterator[str]:
    """The text of every record (a null text is skipped: parquet and arrow columns are nullable)."""
    for record in dataset_records(ds, name):
        if text_field not in record:
            raise DataError(f"dataset={name!r}: a record has no text field {text_field!r} (has: {', '.join(record)})")
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise DataError(f"dataset={name!r}: text field {text_field!r} holds {type(text).__name__}, not a string")
        if text is not None:
            yield text


def dataset_fingerprint(ds, name: str, config: str | None, split: str) -> dict:
    return {"dataset": name, "config": config, "split": split, "fingerprint": getattr(ds, "_fingerprint", None)}


def files_fingerprint(files: list[Path]) -> list[dict]:
    return [{"file": str(p), "bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files]
