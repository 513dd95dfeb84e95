"""Features for the transfer stage: extracted once per checkpoint and data, cached in the store.

A cached file is ``features/<checkpoint fingerprint>/<data checksum>/<name>.arrow``: an Arrow IPC file
with a ``features`` column (fixed-size list of float32, the hidden size), one row per text in input
order, written one record batch per chunk of rows as they are computed (memory holds one chunk, so
IMDB at 8192 units, 1.6 GB of float32, is never whole in memory while it is made) and read back
memory-mapped. The fingerprint hashes the checkpoint's weights, not its URI, so the same weights found
through another path (or re-imported) hit the cache, and different weights never do. Features read in
bf16 or fp16 (a GPU's default, or ``--precision`` on a CPU) are not fp32's: they are kept as
``<name>.<bf16|fp16>.arrow`` beside them, never taken for each other.
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
from models.precision import PRECISION_NAMES, resolve_precision
from tasks.jobs.threads import take_share
from tasks.store import Store, split_object_uri

FEATURES = "features"
CACHE_PREFIX = "features"
# Features are computed and written in chunks of this many bytes (float32), then read memory-mapped.
CHUNK_BYTES = 64 * 2**20


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


def rows_per_chunk(hidden_size: int) -> int:
    """Rows of one chunk of a features file: ``CHUNK_BYTES`` of float32 features (4,096 rows at 4096 units)."""
    return max(1, CHUNK_BYTES // (4 * hidden_size))


def _arrow_columns(
    columns: dict[str, Sequence[object] | np.ndarray] | None, rows: int
) -> dict[str, pa.Array]:
    # Converted once, whole, so every chunk gets the same type (a chunk of None alone would be null).
    arrays = {name: pa.array(values) for name, values in (columns or {}).items()}
    for name, array in arrays.items():
        if len(array) != rows:
            raise ValueError(f"column {name!r} has {len(array)} values for {rows} texts")
    return arrays


def write_features(
    store: Store,
    key: str,
    model: MLSTM,
    texts: Sequence[str],
    *,
    columns: dict[str, Sequence[object] | np.ndarray] | None = None,
    batch_size: int | None = None,
    device: torch.device | None = None,
    on_batch: OnBatch | None = None,
    chunk_rows: int | None = None,
    precision: str = "auto",
) -> str:
    """Compute the features of ``texts`` chunk by chunk, in input order, appending each chunk to the
    Arrow file at ``key`` as one record batch as soon as it is computed: memory holds one chunk
    (``rows_per_chunk``), not the whole [N, H] array. ``batch_size`` None: rows per batch sized by the
    device's memory (``models.features.rows_for_memory``). This process's torch threads are sized for
    the model (``tasks.jobs.threads``). Returns the file's URI."""
    hidden = model.config.hidden_size
    step = chunk_rows or rows_per_chunk(hidden)
    arrays = _arrow_columns(columns, len(texts))
    device = device or default_device()
    take_share(width=hidden)  # in the stage's own process: one thread for a small model
    with store.writer(key) as path, pa.OSFile(str(path), "wb") as sink:
        writer: pa.ipc.RecordBatchFileWriter | None = None
        for start in range(0, max(len(texts), 1), step):
            chunk = list(texts[start : start + step])
            features_NH = (
                featurize(
                    model, chunk, batch_size=batch_size, device=device, on_batch=on_batch, precision=precision
                )
                if chunk
                else np.zeros((0, hidden), dtype=np.float32)
            )
            table = features_table(
                features_NH, **{name: array[start : start + len(chunk)] for name, array in arrays.items()}
            )
            if writer is None:
                writer = pa.ipc.new_file(sink, table.schema)
            writer.write_table(table)
        assert writer is not None  # the loop runs at least once
        writer.close()
    return store.url(key)


def file_shape(store: Store, key: str) -> tuple[int, int | None]:
    """Rows and feature width of a features file, read from its metadata (memory-mapped, no copy);
    the width is None when the file has no fixed-size ``features`` column."""
    with store.local_copy(key) as path:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        field = reader.schema.field(FEATURES) if FEATURES in reader.schema.names else None
        width = field.type.list_size if field and pa.types.is_fixed_size_list(field.type) else None
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches)), width


@dataclass(frozen=True)
class Extracted:
    uri: str  # the cached Arrow file: read it with ``read_table`` (memory-mapped)
    key: str  # its key in the store
    rows: int
    width: int  # the hidden size
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
    batch_size: int | None = None,
    device: torch.device | None = None,
    on_batch: OnBatch | None = None,
    chunk_rows: int | None = None,
    precision: str = "auto",
) -> Extracted:
    """The features file of ``texts`` under ``model``: found in the store's cache, or computed and
    written to it in chunks (``write_features``), with ``columns`` beside them (labels, say) so a
    reader of the file needs nothing else. ``weights`` is the model's ``weights_fingerprint`` when
    the caller has it already. ``precision``: ``models.features.featurize``'s; the cache keeps each
    dtype's features apart."""
    weights = weights or weights_fingerprint(model)
    device = device or default_device()
    dtype = resolve_precision(precision, device)  # featurize warns where bf16 is emulated
    # fp32's name is the one files had before precisions were told apart: those caches stay valid.
    suffix = "" if dtype == torch.float32 else f".{PRECISION_NAMES[dtype]}"
    key = f"{CACHE_PREFIX}/{weights}/{data_checksum or texts_checksum(texts)}/{name}{suffix}.arrow"
    shape = (len(texts), model.config.hidden_size)
    # A cache file that does not fit (written by hand, or truncated elsewhere) is recomputed.
    if store.exists(key) and file_shape(store, key) == shape:
        if on_batch is not None:
            on_batch(len(texts), 0)
        return Extracted(store.url(key), key, *shape, cached=True)
    uri = write_features(
        store, key, model, texts, columns=columns, batch_size=batch_size, device=device,
        on_batch=on_batch, chunk_rows=chunk_rows, precision=PRECISION_NAMES[dtype],
    )  # fmt: skip
    return Extracted(uri, key, *shape, cached=False)


def copy_with_columns(
    store: Store,
    key: str,
    uri: str,
    columns: dict[str, Sequence[object] | np.ndarray] | None = None,
    *,
    endpoint_url: str | None = None,
) -> str:
    """Write the ``features`` column of the file at ``key`` to a path or store URI, chunk by chunk
    (memory-mapped, never whole), with ``columns`` beside it; returns the written file's URI."""
    if "://" not in uri:
        uri = str(Path(uri).resolve())
    target, target_key = split_object_uri(uri, endpoint_url=endpoint_url)
    with store.local_copy(key) as source:
        reader = pa.ipc.open_file(pa.memory_map(str(source)))
        rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        arrays = _arrow_columns(columns, rows)
        schema = pa.schema([*(pa.field(n, a.type) for n, a in arrays.items()), reader.schema.field(FEATURES)])
        with (
            target.writer(target_key) as path,
            pa.OSFile(str(path), "wb") as sink,
            pa.ipc.new_file(sink, schema) as writer,
        ):
            start = 0
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                n = batch.num_rows
                parts = [array[start : start + n] for array in arrays.values()]
                writer.write_batch(pa.record_batch([*parts, batch.column(FEATURES)], schema=schema))
                start += n
    return target.url(target_key)
