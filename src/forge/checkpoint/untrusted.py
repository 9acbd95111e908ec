"""Reading a DCP checkpoint that someone else may have written: nothing in its folder may run code.

DCP's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and its DefaultLoadPlanner reads every
non-tensor value (optimizer hyperparameters, ...) with `torch.load(weights_only=False)`: either runs whatever a
crafted file names. Every DCP read in forge goes through `load_dcp` / `read_metadata` here instead, which unpickle
`.metadata` admitting only the classes DCP metadata holds and read non-tensor values with weights_only=True.
"""

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from forge.checkpoint.errors import CheckpointError, describe

_METADATA_MODULE = dcp_metadata.__name__
METADATA_GLOBALS = frozenset(
    {
        "torch.Size",
        "torch.serialization._get_layout",  # rebuilds torch.strided & co from their name
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "pathlib.PosixPath",  # StorageMeta.checkpoint_id
        "pathlib.PurePosixPath",
        "collections.OrderedDict",
    }
)
"""What a DCP `.metadata` pickle references besides the classes of torch.distributed.checkpoint.metadata and torch
dtypes (found by unpickling forge's checkpoints with a find_class that records every global; PurePosixPath and
OrderedDict are harmless variants other writers may produce)."""


def _admitted(module: str, name: str) -> bool:
    if f"{module}.{name}" in METADATA_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == _METADATA_MODULE:
        value = getattr(dcp_metadata, name, None)
        return isinstance(value, type) and value.__module__ == _METADATA_MODULE
    return False


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose find_class refuses every global but METADATA_GLOBALS, metadata classes and dtypes."""

    def __init__(self, file: io.BufferedIOBase, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise CheckpointError(
                f"refusing to load {self.path}: it references {module}.{name}, which a DCP checkpoint never holds"
            )
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """FileSystemReader whose read_metadata admits only what DCP metadata holds (see _MetadataUnpickler)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, path).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"refusing to load {path}: it holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The checkpoint's DCP metadata, or a CheckpointError naming `.metadata` (refused, missing or corrupt)."""
    try:
        return SafeReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        raise CheckpointError(f"cannot read checkpoint metadata {path / '.metadata'}: {err}") from err


def load_dcp(state: dict, path: Path, no_dist: bool = True, action: str = "load checkpoint") -> None:
    """dcp.load of `state` from `path` through SafeReader and SafePlanner; any failure is a CheckpointError.

    The metadata is read (and refused) first: DCP itself would log a failed read with its traceback and retry.
    """
    read_metadata(path)
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(f"cannot {action} {path}: {describe(err)}") from err
