"""Features for the transfer stage: extracted once per checkpoint and data, cached in the store.

A cached file is ``features/<checkpoint fingerprint>/<data checksum>/<name>.arrow``: an Arrow IPC file
with a ``features`` column (fixed-size list of float32, the hidden size), one row per text in input
order. The fingerprint hashes the checkpoint's weights, not its URI, so the same weights found
through another path (or re-imported) hit the cache, and different weights never do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from models.features import OnBatch, default_device, featurize
from models.mlstm import MLSTM
from tasks.store import Store, split_object_uri

FEATURES = "features"
CACHE_PREFIX = "features"


def weights_fingerprint(model: MLSTM) -> str:
    """sha256 of the model's config and weights (first 16 hex digits): the checkpoint half of the key."""
    digest = hashlib.sha256(repr(model.config).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def texts_checksum(texts: Sequence[str]) -> str:
    """sha256 of the texts in order (length-prefixed, so boundaries count): the data half of the key."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def features_table(features_NH: np.ndarray, **columns: Sequence[object] | np.ndarray) -> pa.Table:
    """An Arrow table with a fixed-size-list ``features`` column and any extra columns."""
    features_NH = np.ascontiguousarray(features_NH, dtype=np.float32)
    values = pa.array(features_NH.reshape(-1), type=pa.float32())
    array = pa.FixedSizeListArray.from_arrays(values, features_NH.shape[1])
    return pa.table({**columns, FEATURES: array})


def features_of(table: pa.Table) -> np.ndarray:
    """The ``features`` column as a float32 array [N, H] (no copy when the table has one chunk)."""
    column = table.column(FEATURES).combine_chunks()
    width = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def write_table(table: pa.Table, store: Store, key: str) -> str:
    """Write an Arrow IPC file to the store (atomically) and return its URI."""
    with (
        store.writer(key) as path,
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table)
    return store.url(key)


def read_table(store: Store, key: str) -> pa.Table:
    with store.local_copy(key) as path:
        # The table's buffers keep the mapping alive after the local copy is gone.
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all()


@dataclass(frozen=True)
class Extracted:
    features: np.ndarray  # [N, H] float32, input order
    uri: str  # the cached Arrow file
    cached: bool  # found in the cache, not computed


def cached_features(
    store: Store,
    model: MLSTM,
    texts: Sequence[str],
    *,
    data_checksum: str | None = None,
    name: str = "rows",
    columns: dict[str, Sequence[object] | np.ndarray] | None = None,
    weights: str | None = None,
    batch_size: int = 64,
    device: torch.device | None = None,
    on_batch: OnBatch | None = None,
) -> Extracted:
    """The features of ``texts`` under ``model``: read from the store's cache, or computed and cached
    (with ``columns`` beside them, labels say, so a reader of the file needs nothing else).
    ``weights`` is the model's ``weights_fingerprint`` when the caller has it already."""
    weights = weights or weights_fingerprint(model)
    key = f"{CACHE_PREFIX}/{weights}/{data_checksum or texts_checksum(texts)}/{name}.arrow"
    if store.exists(key):
        features_NH = features_of(read_table(store, key))
        if features_NH.shape == (len(texts), model.config.hidden_size):
            if on_batch is not None:
                on_batch(len(texts), 0)
            return Extracted(features_NH, store.url(key), cached=True)
        # A cache file that does not fit (written by hand, or truncated elsewhere) is recomputed.
    features_NH = featurize(
        model, list(texts), batch_size=batch_size, device=device or default_device(), on_batch=on_batch
    )
    return Extracted(
        features_NH, write_table(features_table(features_NH, **(columns or {})), store, key), cached=False
    )


def write_output(table: pa.Table, uri: str, *, endpoint_url: str | None = None) -> str:
    """Write a features table to a path or store URI (``s3://bucket/key.arrow``); returns its URI."""
    if "://" not in uri:
        uri = str(Path(uri).resolve())
    store, key = split_object_uri(uri, endpoint_url=endpoint_url)
    return write_table(table, store, key)
