"""A probe on precomputed features: the Arrow files ``mlstm-sentiment features`` writes, labels beside them.

Each file is read memory-mapped (local paths need no copy; a store URI is fetched once), checked
column by column, and handed to ``fit_probe``; every error names the file and the column.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from tasks.store import split_object_uri
from tasks.transfer.probe import DEFAULT_CS, ProbeResult, SweepPoint, fit_probe
from tasks.transfer.solvers import DEFAULT_SOLVER, Solver

SPLITS = ("train", "dev", "test")


# Far above any cell state the mLSTM writes, far below where the probe's sweep loses every weight.
MAX_FEATURE = 1e6


class FeatureFileError(ValueError):
    """A feature file that cannot feed a probe; the message names the file and the column."""


def read_split(
    uri: str,
    *,
    features_column: str = "features",
    label_column: str = "label",
    endpoint_url: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Features [N, H] float32 and labels [N] int64 of one Arrow file (a path or a store URI)."""
    if "://" not in uri:
        uri = str(Path(uri).resolve())
    store, key = split_object_uri(uri, endpoint_url=endpoint_url)
    if not store.exists(key):
        raise FeatureFileError(f"{uri}: no such file")
    with store.local_copy(key) as path:
        try:
            table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid as error:
            raise FeatureFileError(f"{uri}: not an Arrow IPC file ({error})") from None
    for column in (features_column, label_column):
        if column not in table.column_names:
            raise FeatureFileError(f"{uri}: no column {column!r} (columns: {', '.join(table.column_names)})")
    return _features(uri, table, features_column), _labels(uri, table, label_column)


def _features(uri: str, table: pa.Table, column: str) -> np.ndarray:
    array = table.column(column).combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
    elif pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        lengths = np.unique(array.value_lengths().to_numpy(zero_copy_only=False))
        if lengths.size != 1:
            raise FeatureFileError(
                f"{uri}: column {column!r} has rows of different widths {lengths[:5].tolist()}"
            )
        width = int(lengths[0])
    else:
        raise FeatureFileError(f"{uri}: column {column!r} is {array.type}, not a list of numbers per row")
    if array.null_count:
        raise FeatureFileError(f"{uri}: column {column!r} has {array.null_count} empty rows")
    if width == 0:
        raise FeatureFileError(f"{uri}: column {column!r} holds empty vectors: no feature to fit on")
    values = array.flatten()
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise FeatureFileError(f"{uri}: column {column!r} holds {values.type}, not numbers")
    X = values.to_numpy(zero_copy_only=False).reshape(-1, width)
    bad = ~np.isfinite(X)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise FeatureFileError(
            f"{uri}: column {column!r} holds {int(bad.sum())} NaN or inf values (first in row {row})"
        )
    if (largest := float(np.abs(X).max(initial=0.0))) > MAX_FEATURE:
        # An L1 probe on such a scale keeps no weight at any C of the sweep: it would "succeed" with none.
        raise FeatureFileError(
            f"{uri}: column {column!r} holds values up to {largest:.3g}, beyond {MAX_FEATURE:g}: not cell "
            "states (a unit's saturates in the tens); was the file scaled?"
        )
    return X


def _labels(uri: str, table: pa.Table, column: str) -> np.ndarray:
    array = table.column(column)
    if not (
        pa.types.is_integer(array.type) or pa.types.is_boolean(array.type) or pa.types.is_floating(array.type)
    ):
        raise FeatureFileError(
            f"{uri}: column {column!r} is {array.type}: labels are 0 or 1, one number a row"
        )
    if array.null_count:
        raise FeatureFileError(f"{uri}: column {column!r} has {array.null_count} empty labels")
    y = array.to_numpy()
    classes = np.unique(y)
    if not np.isin(classes, [0, 1]).all():
        raise FeatureFileError(f"{uri}: column {column!r} must hold 0 or 1, got {classes[:10].tolist()}")
    if classes.size < 2:
        raise FeatureFileError(
            f"{uri}: column {column!r} holds one class only ({classes.tolist()}); a probe needs both"
        )
    return y.astype(np.int64)


def probe_files(
    train: str,
    dev: str,
    test: str,
    *,
    features_column: str = "features",
    label_column: str = "label",
    solver: Solver = DEFAULT_SOLVER,
    seed: int = 0,
    device: str = "cpu",
    Cs: Sequence[float] = DEFAULT_CS,
    endpoint_url: str | None = None,
    on_fit: Callable[[SweepPoint], None] | None = None,
) -> tuple[ProbeResult, dict[str, float | int]]:
    """Fit the probe on three feature files; returns the result and the ``--json`` summary (with seconds)."""
    uris = dict(zip(SPLITS, (train, dev, test), strict=True))
    data = {
        split: read_split(
            uri, features_column=features_column, label_column=label_column, endpoint_url=endpoint_url
        )
        for split, uri in uris.items()
    }
    widths = {uris[split]: X.shape[1] for split, (X, _) in data.items()}
    if len(set(widths.values())) != 1:
        raise FeatureFileError(f"column {features_column!r} has different widths across files: {widths}")
    started = time.perf_counter()
    result = fit_probe(
        *data["train"],
        *data["dev"],
        *data["test"],
        Cs=Cs,
        solver=solver,
        seed=seed,
        device=device,
        on_fit=on_fit,
    )
    return result, {**result.summary(), "seconds": round(time.perf_counter() - started, 3)}
