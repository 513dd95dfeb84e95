"""Reading torch.distributed.checkpoint (DCP) files as data: nothing in a sharded checkpoint runs code.

DCP reads its ``.metadata`` index with a plain ``pickle.load``, and any value it stored as bytes with
``torch.load(weights_only=False)``: whoever can write the store could make a resume or a consolidation
run their code (torch's policy is that loading a checkpoint is running code; pytorch/pytorch#189308
asks for this hardening). Here the index goes through an unpickler that builds only the types a DCP
index is made of (its metadata dataclasses, tensor sizes, dtypes, layouts, paths), and stored bytes go
through ``torch.load(weights_only=True)``; anything else is refused with ``ForgedIndex``, naming the
file and the type, before a byte of it is acted on. This holds with or without a checkpoint key: the
key says whose files they are, this says they are only data.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

INDEX = ".metadata"

# What a DCP index is built from (torch 2.13's writer: tests/test_checkpoints.py checks a real index
# reads with no more than this).
_DCP_TYPES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    # A layout by its name, from a fixed table of torch's layouts: a lookup, not a call of the file's choosing.
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class ForgedIndex(ValueError):
    """A DCP file that holds something other than data (a type no DCP index holds): refused, not run."""


class _IndexUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the names a DCP index is made of (the standard library's
    "restricting globals" recipe)."""

    def __init__(self, file: io.BufferedIOBase, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_TYPES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ForgedIndex(
            f"{self.path} holds {module}.{name}, which no DCP index holds: refused, not run (the "
            "checkpoint was written by something other than a training job; see docs/operations.md, Trust)"
        )


def read_index(path: Path) -> dcp_metadata.Metadata:
    """A DCP ``.metadata`` file as DCP's ``Metadata``, built from data only (``ForgedIndex`` if not)."""
    with open(path, "rb") as file:
        try:
            index = _IndexUnpickler(file, str(path)).load()
        except ForgedIndex:
            raise
        except Exception as error:  # a cut-short or garbled pickle: damage, not a forgery
            raise ForgedIndex(f"{path} is not a DCP index: {error}") from None
    if not isinstance(index, dcp_metadata.Metadata):
        raise ForgedIndex(f"{path} holds a {type(index).__name__}, not a DCP index: refused")
    return index


class DataOnlyReader(FileSystemReader):
    """DCP's file-system reader with its index read by ``read_index``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        index = read_index(Path(self.path) / INDEX)
        meta = index.storage_meta or dcp_metadata.StorageMeta()
        meta.load_id = self.load_id
        index.storage_meta = meta
        return index


def _load_bytes_as_data(value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ForgedIndex(f"a value stored as bytes in a DCP file is not plain data: {error}") from None


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with values stored as bytes read as data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _as_data(value))


def _as_data(value: io.BytesIO) -> io.BytesIO:
    """A stored value read with ``weights_only=True`` and saved again, so that DCP's own
    ``torch.load(weights_only=False)`` of it meets only what ``weights_only`` let through."""
    buffer = io.BytesIO()
    torch.save(_load_bytes_as_data(value), buffer)
    buffer.seek(0)
    return buffer


class _DataOnlyEmptyPlanner(_EmptyStateDictLoadPlanner):
    """The planner that builds a whole state dict from the index (consolidation), bytes read as data."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _as_data(value))


@contextlib.contextmanager
def _refusals_named(directory: Path) -> Iterator[None]:
    """Check the index before DCP reads it, and pass on a refusal DCP met inside its workers as itself
    (DCP wraps every rank's error in a ``CheckpointException``, a ``BaseException``)."""
    read_index(directory / INDEX)
    try:
        yield
    except CheckpointException as error:
        for failure, _trace in error.failures.values():
            if isinstance(failure, ForgedIndex):
                raise ForgedIndex(f"{directory}: {failure}") from None
        raise


def load_into(state: dict[str, Any], directory: Path) -> None:
    """``dcp.load`` of ``directory`` into ``state`` (every rank calls it), reading data only."""
    with _refusals_named(directory):
        dcp.load(state, storage_reader=DataOnlyReader(directory), planner=DataOnlyPlanner())


def read_whole(directory: Path) -> dict[str, Any]:
    """Every tensor and value of a DCP checkpoint as one state dict, in this process (no process group),
    reading data only: what ``dcp_to_torch_save`` builds, without its plain pickle."""
    state: dict[str, Any] = {}
    with _refusals_named(directory):
        _load_state_dict(
            state, storage_reader=DataOnlyReader(directory), planner=_DataOnlyEmptyPlanner(), no_dist=True
        )
    return state
