"""Read a W&B offline run file (run-ID.wandb) back with wandb's own protobuf Record messages.

The file is a LevelDB-style log: a 7-byte file header (":W&B", magic 0xBEE1, version), then records in 32 KiB
blocks, each chunk with a 7-byte header (crc32, length, type: full/first/middle/last). wandb >= 0.19 ships no
Python reader any more, so this is the format's reader in a few lines.
"""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, "not a W&B run file"
    records, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(path: Path) -> list[dict]:
    """The logged history rows: {key: value} with `_step`."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def run_ids(path: Path) -> list[str]:
    return [r.run.run_id for r in read_records(path) if r.WhichOneof("record_type") == "run"]
