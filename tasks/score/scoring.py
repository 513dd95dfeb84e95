"""The plain work of a scoring run: plan it, score one piece, write the manifest. No Prefect here.

An output is a folder ``<OUTPUT>/<scoring id>/`` of the model version, the inputs' content and the
settings; another champion or other inputs give another folder, so versions never mix in one:

    part-NNNNN.parquet            one per piece: the id columns, input_file, input_row, probability,
                                  label, sentiment_unit, model_version
    rejected/part-NNNNN.parquet   the piece's rows that could not be scored, with the reason
    pieces/NNNNN.json             written after both: the piece is done (its rows, checksums, labels)
    precision.json                under ``--precision auto``: the dtype its first scored piece read in,
                                  which every later piece reads in (``output_dtype``)
    manifest.json                 written last: rows in and out, rejects, checksums, model, inputs

Every file is published atomically (``Store.writer``) and the manifest last, so a reader that finds
the manifest finds every file it names whole. A rerun skips the pieces whose ``pieces/`` file exists:
a killed run resumes where it stopped.

A piece is not a run of consecutive rows: a file is read in windows of ``WINDOW_PIECES`` pieces' rows,
and a window's rows, ordered by their text's length (longest first), are cut into its pieces, parts of
like bytes (``window_cuts``). The features path reads a batch for as many steps as its longest text has
bytes, so a piece of rows as they come (reviews of every length) costs many more steps than the same
rows among others of their length.
On IMDB's test set, pieces of 1,024 rows take 33 steps a row consecutive, 5.5 cut from windows.
Within a part file rows keep their input order (``input_row``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pyarrow as pa

from tasks.jobs.config import Precision
from tasks.jobs.threads import take_share
from tasks.score.config import PIECE_ROWS
from tasks.score.inputs import InputError, InputFile, describe, expand_inputs, read_rows
from tasks.score.readers.base import PROBLEM
from tasks.score.readers.text import text_bytes, texts_of
from tasks.store import Store, check_target, open_store

PRECISIONS = get_args(Precision)  # models.precision.PRECISION_CHOICES (tests/test_features.py)
FORMAT_VERSION = 2  # of the output's layout; part of the scoring id (2: pieces cut by length in windows)
# Pieces per window: a window's rows are ordered by length before they are cut. Each piece reads its
# whole window (a worker keeps the last one read), so this bounds a worker's memory: 16 × 1,024 IMDB
# reviews are 21 MB of text.
WINDOW_PIECES = 16
PRECISION_KEY = "precision.json"  # an auto output's dtype, claimed by its first piece scored
HISTOGRAM_BINS = 20  # of P(positive) over [0, 1], summed from the pieces for the run's plot
OWN_COLUMNS = ("input_file", "input_row", "probability", "label", "sentiment_unit", "model_version", "reason")


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """The registered classifier a run scores with, resolved to one version."""

    uri: str  # as the user named it: models:/NAME@champion
    name: str
    version: int
    run_id: str | None  # the run that logged it
    folder: str  # a local folder with classifier.json and classifier.npz
    unit: int  # the sentiment unit: the probe's largest weight
    max_text_chars: int
    weights_sha256: str  # a registry rebuilt from scratch may give other weights the same version


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Part ``part`` of ``parts`` of the window ``[start, stop)`` of the file's rows (``window_cuts``)."""

    index: int
    file: InputFile
    start: int
    stop: int
    part: int
    parts: int

    @property
    def name(self) -> str:
        return f"{self.index:05d}"


@dataclass(frozen=True, kw_only=True)
class Plan:
    scoring_id: str
    output: str  # the output folder's URI: <OUTPUT>/<scoring id>
    model: ModelRef
    files: tuple[InputFile, ...]
    pieces: tuple[Piece, ...]
    text_column: str
    id_columns: tuple[str, ...]
    precision: str = "auto"  # the model's products' dtype (models.precision.feature_precision)
    s3_endpoint_url: str | None = field(default=None, compare=False)

    def store(self) -> Store:
        return open_store(self.output, endpoint_url=self.s3_endpoint_url)

    def for_pieces(self) -> Plan:
        """The plan as each piece's task takes it: without the files and pieces, which a piece does not
        read (it carries its own window of its file). Sent whole, each of N tasks carried all N pieces:
        O(N²) to send and for Prefect to walk, looking for futures (99 ms a task at 3,907 pieces)."""
        return replace(self, files=(), pieces=())


def describe_inputs(
    inputs: list[str],
    *,
    text_column: str = "text",
    id_columns: list[str] | None = None,
    s3_endpoint_url: str | None = None,
    output: str | None = None,
    on_start: Callable[[int], None] = lambda _: None,
    on_progress: Callable[[float], None] | None = None,
) -> tuple[InputFile, ...]:
    """Find, hash and count the inputs: a bad file fails here, before any model is loaded or row scored.
    ``on_start``: told the number of files found; ``on_progress``: the files described, in fractions of a
    file as each one's passes go (``describe``)."""
    id_columns = list(id_columns or [])
    if clash := [c for c in id_columns if c in OWN_COLUMNS or c == text_column]:
        raise ValueError(f"--id-column {clash[0]!r} is the text column or one the output writes itself")
    # A second run into a folder of its inputs must not read the first run's output as one.
    uris = expand_inputs(inputs, s3_endpoint_url=s3_endpoint_url, output=output)
    if output is not None:  # named by its flag, before the inputs are read, and nothing made yet
        check_target(output, "--output", endpoint_url=s3_endpoint_url)
    on_start(len(uris))
    files = tuple(
        describe(
            uri,
            text_column=text_column,
            id_columns=id_columns,
            s3_endpoint_url=s3_endpoint_url,
            on_progress=on_progress,
        )
        for uri in uris
    )
    if not any(file.rows for file in files):  # header-only tables: refused before Prefect starts
        raise InputError(f"{', '.join(f.uri for f in files)}: no rows to score")
    return files


def save_described(files: tuple[InputFile, ...], path: Path) -> Path:
    """Write the inputs as ``describe_inputs`` found them, for ``load_described``: a flow run takes
    this file's path, not the list, since Prefect refuses a flow run's parameters over 512 KB and the
    offsets of 82M reviews (the 2014 corpus) are 1 MB of JSON."""
    path.write_text(json.dumps([asdict(f) for f in files]))
    return path


def load_described(path: str) -> tuple[InputFile, ...]:
    return tuple(
        InputFile(**{**entry, "offsets": tuple(entry["offsets"])})
        for entry in json.loads(Path(path).read_text())
    )


def cut_pieces(files: tuple[InputFile, ...], piece_rows: int) -> list[tuple[InputFile, int, int, int, int]]:
    """The pieces of ``files``, each (file, window start, window stop, part, parts): windows of
    ``WINDOW_PIECES`` pieces' consecutive rows, each cut into parts of ``piece_rows`` rows on average."""
    window_rows = piece_rows * WINDOW_PIECES
    return [
        (file, start, stop, part, parts)
        for file in files
        for start in range(0, file.rows, window_rows)
        for stop in [min(start + window_rows, file.rows)]
        for parts in [-(-(stop - start) // piece_rows)]
        for part in range(parts)
    ]


def plan_scoring(
    files: tuple[InputFile, ...],
    output: str,
    model: ModelRef,
    *,
    text_column: str = "text",
    id_columns: list[str] | None = None,
    piece_rows: int = PIECE_ROWS,
    precision: str = "auto",
    s3_endpoint_url: str | None = None,
) -> Plan:
    """Name the output by the model version, the inputs' content and the settings, and cut the inputs
    into pieces of ``piece_rows`` rows on average: windows of ``WINDOW_PIECES`` pieces' consecutive
    rows, each cut in its rows' length order into parts of like bytes (``window_cuts``).
    ``precision``: the dtype the model reads in (``models.precision.feature_precision``: a probe's
    features, a fine-tuned model's logits); one other than auto names another output, so a run never
    mixes the scores of two."""
    id_columns = list(id_columns or [])
    if piece_rows < 1:
        raise ValueError(f"piece_rows must be at least 1, got {piece_rows}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    key = {
        "format": FORMAT_VERSION,
        "model": [model.name, model.version, model.weights_sha256],
        "inputs": [[f.name, f.sha256] for f in files],
        "text_column": text_column,
        "id_columns": id_columns,
        "piece_rows": piece_rows,
        "window_pieces": WINDOW_PIECES,
        # auto is left out, so that outputs named before the setting existed are still found.
        **({"precision": precision} if precision != "auto" else {}),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    scoring_id = f"{re.sub(r'[^A-Za-z0-9_.-]', '-', model.name)}-v{model.version}-{digest}"
    pieces = cut_pieces(files, piece_rows)
    if not pieces:
        raise InputError(f"{', '.join(f.uri for f in files)}: no rows to score")
    root = open_store(output, endpoint_url=s3_endpoint_url)
    return Plan(
        scoring_id=scoring_id,
        output=root.url(scoring_id),
        model=model,
        files=files,
        pieces=tuple(
            Piece(index=i, file=f.window(a, b), start=a, stop=b, part=part, parts=parts)
            for i, (f, a, b, part, parts) in enumerate(pieces)
        ),
        text_column=text_column,
        id_columns=tuple(id_columns),
        precision=precision,
        s3_endpoint_url=s3_endpoint_url,
    )


# ---------------------------------------------------------------------------------------------
# One piece


@functools.lru_cache(maxsize=2)
def _classifier(folder: str, weights_sha256: str) -> Any:
    """Loaded once per worker process, whatever number of pieces it scores. Keyed by the weights too: a
    Dask worker outlives a run, and a registry rebuilt from scratch may put other weights in the same
    version's folder."""
    from models.classifier import SentimentClassifier
    from models.finetuned import FinetunedClassifier, is_finetuned

    if is_finetuned(Path(folder)):
        return FinetunedClassifier.load(Path(folder))
    return SentimentClassifier.load(Path(folder))


@functools.lru_cache(maxsize=1)
def _window(
    file: InputFile,
    start: int,
    stop: int,
    text_column: str,
    id_columns: tuple[str, ...],
    s3_endpoint_url: str | None,
    parts: int,
) -> tuple[pa.Table, list[np.ndarray]]:
    """A window's rows and its pieces' rows (``window_cuts``). The last window read is kept: a worker
    often scores the next piece of the same window, and then reads nothing."""
    table = read_rows(
        file,
        start,
        stop,
        text_column=text_column,
        id_columns=list(id_columns),
        s3_endpoint_url=s3_endpoint_url,
    )
    return table, window_cuts(table.column(text_column), parts)


def window_order(texts: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Row positions by the text's length in bytes, longest first (ties in row order): pieces cut from
    this order hold texts of like length, so the features path pads little and steps few times."""
    return np.argsort(-text_bytes(texts), kind="stable")


ROW_BYTES = 64  # what a row costs beside its text's bytes, when a window is cut into parts


def window_cuts(texts: pa.ChunkedArray | pa.Array, parts: int) -> list[np.ndarray]:
    """The window's rows (positions, in input order) of each of its ``parts`` pieces: the length order
    (``window_order``) cut into parts of like bytes, the longest texts first. Like bytes, not like rows:
    the first 1,024 of 4,000 IMDB reviews by length hold half their bytes, and a worker that scored
    that piece and one more would hold the run up. Every part has a row where the window has enough."""
    order_W = window_order(texts)
    cost_W = np.cumsum(text_bytes(texts)[order_W] + ROW_BYTES)
    num_rows = len(order_W)
    cuts = [0]
    for j in range(1, parts):
        cut = int(np.searchsorted(cost_W, cost_W[-1] * j / parts))
        cuts.append(min(max(cut, cuts[-1] + 1), num_rows - (parts - j)))
    cuts.append(num_rows)
    return [np.sort(order_W[a:b]) for a, b in itertools.pairwise(cuts)]


def _device() -> Any:
    """The CPU, or a GPU: with several, each worker process takes one by its process id (a spread, not
    a reservation: a pool of as many workers as GPUs may still put two on one)."""
    import torch

    from models.features import default_device

    device = default_device()
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        return torch.device("cuda", os.getpid() % torch.cuda.device_count())
    return device


def batch_memory(device: Any, *, workers: int, budget: int) -> int:
    """Bytes one worker's feature batches may take: on a CPU its share of the run's ``budget``, on a GPU
    half that GPU's free memory shared by the workers on it. Without the share, N workers would each
    take the whole budget, and memory would grow with the workers."""
    import torch

    from models.features import batch_memory_default

    if device.type == "cuda":
        sharing = -(-workers // torch.cuda.device_count())
        return batch_memory_default(device) // sharing
    return budget // workers


def piece_done(plan: Plan, piece: Piece) -> dict[str, Any] | None:
    store = plan.store()
    key = f"pieces/{piece.name}.json"
    return json.loads(store.read_bytes(key)) if store.exists(key) else None


def output_dtype(plan: Plan, device: Any) -> str:
    """The dtype this piece reads in: an explicit precision's own (it names its own output); under
    ``auto``, the one its output's first scored piece resolved auto to on its device, claimed in
    ``precision.json`` (``Store.create``: one writer wins). ``auto`` is bf16 on a GPU and fp32 on a CPU,
    so without the claim a run resumed on another kind of machine, or a cluster of CPU and GPU workers,
    would mix two dtypes' scores in one output."""
    from models.precision import PRECISION_NAMES, resolve_precision

    if plan.precision != "auto":
        return plan.precision
    store = plan.store()
    own = PRECISION_NAMES[resolve_precision("auto", device)]
    if store.create(PRECISION_KEY, json.dumps({"precision": "auto", "dtype": own}).encode()):
        return own
    # A local store's claim is its file created, then written: another worker may read it in between.
    for _ in range(100):
        with contextlib.suppress(json.JSONDecodeError):
            return str(json.loads(store.read_bytes(PRECISION_KEY))["dtype"])
        time.sleep(0.05)
    raise InputError(f"{store.url(PRECISION_KEY)}: not the dtype record a scoring run writes")


def score_piece(
    plan: Plan,
    piece: Piece,
    *,
    threads: int | None = None,
    batch_size: int | None = None,
    workers: int = 1,
    memory_budget: int | None = None,
    on_rows: Any = None,
    on_batch: Any = None,
) -> dict[str, Any]:
    """Score one piece and publish its part, its rejects and then its ``pieces/`` record; a piece whose
    record exists is skipped (``skipped`` True). ``batch_size`` None: rows per batch sized by memory,
    longest texts first, as the features path batches (``models.features.featurize``): this worker's
    share of ``memory_budget`` bytes among ``workers`` (``batch_memory``), or the features path's own
    default where no budget is given. ``threads``: this worker's torch threads; None: its share of the
    cores among ``workers``, one for a small model (``tasks.jobs.threads``). ``on_rows`` is told the
    piece's rows once they are known (its window read), ``on_batch`` each batch scored."""
    if (done := piece_done(plan, piece)) is not None:
        return {**done, "skipped": True}
    from models.classifier import LABELS, labels_of, probability
    from models.features import featurize

    started = time.perf_counter()
    window, cuts = _window(
        piece.file,
        piece.start,
        piece.stop,
        plan.text_column,
        plan.id_columns,
        plan.s3_endpoint_url,
        piece.parts,
    )
    if window.num_rows != piece.stop - piece.start:
        raise InputError(
            f"{piece.file.uri}: has {piece.start + window.num_rows} rows, rows {piece.start}–{piece.stop} "
            "were planned (did it change?)"
        )
    taken_N = cuts[piece.part]  # the piece's rows, in input order
    if on_rows is not None:
        on_rows(len(taken_N))
    table = window.take(pa.array(taken_N))
    problems = table.column(PROBLEM) if PROBLEM in table.column_names else None
    texts, reasons = texts_of(table.column(plan.text_column), problems, max_chars=plan.model.max_text_chars)
    good = np.array([t is not None for t in texts], dtype=bool)
    kept = [t for t in texts if t is not None]
    classifier = _classifier(plan.model.folder, plan.model.weights_sha256)
    lm = getattr(classifier.model, "lm", classifier.model)  # a fine-tuned model's mLSTM, or the probe's
    take_share(sharers=workers, width=lm.config.hidden_size, explicit=threads)
    device = _device()
    dtype = output_dtype(plan, device)
    if hasattr(classifier, "coef_H"):  # a probe on the frozen features
        memory_bytes = (
            None if memory_budget is None else batch_memory(device, workers=workers, budget=memory_budget)
        )
        features_NH = featurize(
            classifier.model,
            kept,
            batch_size=batch_size,
            device=device,
            on_batch=on_batch,
            memory_bytes=memory_bytes,
            precision=dtype,
        )
        p_N = probability(features_NH, classifier.coef_H, classifier.intercept)
        unit_N = features_NH[:, plan.model.unit]
    else:  # fine-tuned: its own pooling and head; no sentiment unit to report
        classifier.model.to(device)
        p_N = classifier.predict_proba(kept, batch_size=batch_size or 64, precision=dtype, on_batch=on_batch)
        unit_N = np.full(len(kept), np.nan, dtype=np.float32)
    labels = labels_of(p_N)
    rows_N = piece.start + taken_N.astype(np.int64)
    ids = {name: table.column(name).combine_chunks() for name in plan.id_columns}
    good_mask = pa.array(good)
    scored = pa.table(
        {
            **{name: column.filter(good_mask) for name, column in ids.items()},
            "input_file": pa.array([piece.file.name] * len(kept), type=pa.string()),
            "input_row": pa.array(rows_N[good]),
            "probability": pa.array(p_N, type=pa.float64()),
            "label": pa.array(labels, type=pa.string()),
            "sentiment_unit": pa.array(unit_N, type=pa.float32()),
            "model_version": pa.array([plan.model.version] * len(kept), type=pa.int64()),
        }
    )
    bad_mask = pa.array(~good)
    rejected = pa.table(
        {
            **{name: column.filter(bad_mask) for name, column in ids.items()},
            "input_file": pa.array([piece.file.name] * int((~good).sum()), type=pa.string()),
            "input_row": pa.array(rows_N[~good]),
            "reason": pa.array([r for r in reasons if r is not None], type=pa.string()),
        }
    )
    store = plan.store()
    part = _write_parquet(store, f"part-{piece.name}.parquet", scored)
    aside = _write_parquet(store, f"rejected/part-{piece.name}.parquet", rejected)
    counts, _ = np.histogram(p_N, bins=HISTOGRAM_BINS, range=(0.0, 1.0))
    record = {
        "piece": piece.index,
        "input": piece.file.name,
        "window": [piece.start, piece.stop],
        "part": [piece.part, piece.parts],
        "rows_in": len(taken_N),
        "rows_out": len(kept),
        "rejected": int((~good).sum()),
        "dtype": dtype,
        "reasons": dict(Counter(r.split(" at byte")[0] for r in reasons if r is not None)),
        "chars": sum(len(t) for t in kept),
        "labels": {label: labels.count(label) for label in LABELS},
        "histogram": counts.tolist(),
        "seconds": time.perf_counter() - started,
        "files": [part, aside],
    }
    store.write_bytes(f"pieces/{piece.name}.json", json.dumps(record, indent=1).encode())
    return {**record, "skipped": False}


def _write_parquet(store: Store, key: str, table: pa.Table) -> dict[str, Any]:
    """Publish a Parquet file atomically; its key, bytes and sha256 for the manifest."""
    import pyarrow.parquet as pq

    with store.writer(key) as path:
        pq.write_table(table, str(path), compression="zstd")
        data = path.read_bytes()
    return {
        "key": key,
        "rows": table.num_rows,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


# ---------------------------------------------------------------------------------------------
# The manifest


def build_manifest(plan: Plan, records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """What the run wrote, from every piece's record: the manifest, without its own checksum."""
    records = sorted(records, key=lambda r: r["piece"])
    assert [r["piece"] for r in records] == [p.index for p in plan.pieces], "a piece has no record"
    reasons: Counter[str] = Counter()
    labels: Counter[str] = Counter()
    for r in records:
        reasons.update(r["reasons"])
        labels.update(r["labels"])
    rows_out = sum(r["rows_out"] for r in records)
    return {
        "scoring_id": plan.scoring_id,
        "output": plan.output,
        "model": {k: v for k, v in asdict(plan.model).items() if k != "folder"},
        "text_column": plan.text_column,
        "id_columns": list(plan.id_columns),
        "precision": plan.precision,
        # What the pieces read in (auto resolved); pieces scored before records held it say nothing.
        "dtype": ", ".join(sorted({r["dtype"] for r in records if "dtype" in r})) or None,
        # A file's row offsets are how to read it, not what was read: the manifest names inputs as before.
        "inputs": [{k: v for k, v in asdict(f).items() if k != "offsets"} for f in plan.files],
        "rows_in": sum(f.rows for f in plan.files),
        "rows_out": rows_out,
        "rejected": {"rows": sum(r["rejected"] for r in records), "reasons": dict(sorted(reasons.items()))},
        "labels": dict(sorted(labels.items())),
        "chars": sum(r["chars"] for r in records),
        "histogram": {
            "bins": HISTOGRAM_BINS,
            "counts": np.sum([r["histogram"] for r in records], axis=0).astype(int).tolist(),
        },
        "files": [file for r in records for file in r["files"]],
        # This run's own work (a resumed run skips what was done before): rows/s counts these.
        "pieces": {
            "scored": sum(not r.get("skipped") for r in records),
            "skipped": sum(bool(r.get("skipped")) for r in records),
            "rows_scored": sum(r["rows_out"] for r in records if not r.get("skipped")),
            "chars_scored": sum(r["chars"] for r in records if not r.get("skipped")),
        },
        "seconds": seconds,
    }


def publish_manifest(plan: Plan, manifest: dict[str, Any]) -> str:
    store = plan.store()
    store.write_bytes("manifest.json", json.dumps(manifest, indent=2).encode())
    return store.url("manifest.json")


def read_manifest(plan: Plan) -> dict[str, Any] | None:
    store = plan.store()
    return json.loads(store.read_bytes("manifest.json")) if store.exists("manifest.json") else None


def verify(output: str, *, s3_endpoint_url: str | None = None) -> list[str]:
    """The files of a published output whose bytes differ from the manifest's sha256 (empty: all verify)."""
    store = open_store(output, endpoint_url=s3_endpoint_url)
    manifest = json.loads(store.read_bytes("manifest.json"))
    return [
        f["key"]
        for f in manifest["files"]
        if hashlib.sha256(store.read_bytes(f["key"])).hexdigest() != f["sha256"]
    ]
