#!/usr/bin/env python
"""Feature extraction throughput against a per-text loop of the same model, and the served model's latency.

Feature throughput, per preset, on the device at hand (CUDA when torch sees one, under the autocast
``models.features.featurize`` uses; else the CPU in fp32), on real review text (SST-2 test sentences by
default on a CPU, IMDB test reviews on a GPU, as issue 13 measures; ``--data`` takes any CSV with a ``sentence``, ``text`` or ``review`` column, ``.csv.gz`` too):

- fast: ``models.features.featurize``, the code the features CLI and the served model run: texts
  packed end to end (``models.features.pack``) into as many rows as fit half the device's free memory,
  or ``--batch-size``, and no more than can be kept reading until the longest text ends; each row's
  state restarts where a text starts, through the fused recurrence (``models/recurrence.py``:
  ``packed_states``, rows leave as they run out of texts);
- reference: ``featurize`` with the model's ``recurrence="reference"``: texts read longest first in
  length-bucketed batches (padding under 10% of the bytes a batch holds), the cell step by step, padding
  masked with ``torch.where``: the path features took before the fused recurrence;
- baseline: the same model, one text at a time (batch of 1, no sorting, no padding) through
  ``model(bytes[None])``, the feature being the final cell state it returns.

chars/s are the bytes the model reads (the cleaned text, UTF-8, with its "\\n " and " " pads) per second,
warm-up excluded, encoding and copies back to the host included for both. The two paths see different
numbers of texts (the baseline is slow), so compare rates. The weights are random (seed 0): speed does
not depend on them. Every text the baseline read is also compared with the fast path's feature for it:
max rel diff = the largest, over those texts, of max|fast − baseline| ÷ max|baseline| (fails above 1e-4
in fp32).

``--precisions auto,bf16`` measures each preset once per precision (auto: bf16 or fp16 on a GPU, fp32
on a CPU; bf16 on a CPU runs the products in bf16, ``featurize(precision=...)``), the three paths of a
row in that precision; the report then gives each row's fast path against the first precision's
(chars/s ratio, and max rel diff of its features from the first's: what a probe fitted on one sees in
the other).

Served-model latency: a ``SentimentClassifier`` of ``--serve-preset`` with random probe weights is logged
with ``tasks.transfer.registry.log_classifier`` to a temporary MLflow store (SQLite), served by
``mlflow models serve --env-manager local --workers 1``, and timed over HTTP: ``--requests`` POSTs to
``/invocations`` of one sentence and of ``--serve-batch`` sentences, after ``--warmup-requests`` each,
once per ``--precisions`` (the request's ``precision`` parameter; auto sends none). The served model
loads on the CPU (``models/serving.py``), whatever device the feature rows ran on.

    PYTHONPATH=. .venv/bin/python benchmarks/features.py                    # defaults picked by device
    PYTHONPATH=. .venv/bin/python benchmarks/features.py --presets tiny --texts 32 --baseline-texts 8 \\
        --requests 3 --serve-preset tiny --json                             # JSON on stdout, tables on stderr
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import gzip
import json
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (  # the working tree on the path
    REPO,
    add_record_option,
    machine,
    new_parser,
    precision_line,
    profile_table,
    record,
    say,
)

from models.features import featurize, length_batches, pack, rows_for_memory
from models.mlstm import MLSTM, PRESETS, preset
from models.precision import PRECISION_CHOICES, PRECISION_NAMES, autocast, resolve_precision
from models.text import encode

# The shared data beside the checkout, or where MLSTM_SHARED_DIR says (a worktree elsewhere).
SHARED_DATA = Path(os.environ.get("MLSTM_SHARED_DIR", REPO.parent / "shared")) / "data"
DEFAULT_DATA = SHARED_DATA / "sst2" / "test_binary_sent.csv"
DEFAULT_GPU_DATA = SHARED_DATA / "imdb" / "test.csv.gz"
TEXT_COLUMNS = ("sentence", "text", "review")
# (texts for the fast path, texts for the baseline) per preset, when --texts / --baseline-texts are not
# given. The CPU ones finish in a few minutes in all on 2 cores (paper_4096 is ~170 MFLOP per byte): 64
# texts make one full batch, where batching starts to pay on a CPU.
CPU_COUNTS = {"tiny": (512, 64), "small": (256, 32), "paper_4096": (64, 4), "paper_8192": (16, 1)}
# On a GPU one text at a time is launch-bound (an H200 read 4.8k chars/s of IMDB that way at paper_4096):
# a few dozen texts give its rate; more only lengthen the run.
GPU_COUNTS = {"tiny": (2048, 256), "small": (2048, 128), "paper_4096": (2048, 32), "paper_8192": (2048, 16)}
CPU_REQUESTS, GPU_REQUESTS = 20, 50  # a request of 64 texts of `small` takes seconds on 2 CPU cores
# The fast path and the baseline run the same weights on the same bytes: in fp32 they differ only by
# summation order. Under bf16/fp16 autocast the recurrence rounds differently in a batch and alone.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
SERVE_TIMEOUT_S = 300  # for the server to answer /ping: it imports MLflow and torch, loads the model


# ---------------------------------------------------------------------------------------------
# Texts


def load_texts(path: Path) -> list[str]:
    """The non-empty texts of a CSV (``.csv`` or ``.csv.gz``) with a ``sentence``, ``text`` or ``review`` column."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="", encoding="utf-8") as stream:
        reader = csv.DictReader(stream)
        column = next((c for c in TEXT_COLUMNS if c in (reader.fieldnames or [])), None)
        if column is None:
            raise ValueError(
                f"{path}: no column named one of {', '.join(TEXT_COLUMNS)} ({reader.fieldnames})"
            )
        return [row[column] for row in reader if row[column] and row[column].strip()]


def generated_texts() -> list[str]:
    """The project's generated labelled sample (``tasks.corpus.sample.write_labelled_sample``), all splits."""
    from tasks.corpus.sample import write_labelled_sample

    with tempfile.TemporaryDirectory(prefix="mlstm-bench-sample-") as scratch:
        folder = write_labelled_sample(Path(scratch) / "reviews")
        return [text for split in ("train", "dev", "test") for text in load_texts(folder / f"{split}.csv")]


def take(pool: list[str], n: int) -> list[str]:
    """The first ``n`` texts of the pool, going round again when it has fewer."""
    return [pool[i % len(pool)] for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Feature throughput


@dataclass
class FeatureRow:
    preset: str
    num_params: int
    device: str
    precision: str  # the products' dtype: fp32, bf16 or fp16
    batch_size: int  # rows per batch at most: --batch-size, or sized by memory
    batch_sized_by: str  # "memory" or "--batch-size"
    texts: int
    chars: int  # bytes the model read
    padding: float  # padding bytes ÷ the bytes the reference path's length-bucketed batches hold
    rows: int  # rows the fast path packed the texts into (models.features.pack)
    steps: int  # its steps
    idle: float  # its row-steps that read no byte (as rows run out of texts at the end) ÷ all of them
    seconds: float
    chars_per_s: float
    reference_seconds: float
    reference_chars_per_s: float
    vs_reference: float  # fast chars/s ÷ reference chars/s
    baseline_texts: int
    baseline_chars: int
    baseline_seconds: float
    baseline_chars_per_s: float
    ratio: float  # fast chars/s ÷ baseline chars/s
    max_rel_diff: float  # over the baseline's texts: max|fast − baseline| ÷ max|baseline|, the largest
    tolerance: float
    # Against the first precision's row of the same preset (--precisions): fast chars/s ratio, and the
    # largest max|this − that| ÷ max|that| over the fast path's texts. None for the first.
    vs_first_precision: float | None = None
    first_precision_rel_diff: float | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def precision_of(device: torch.device, precision: str = "auto") -> str:
    return PRECISION_NAMES[resolve_precision(precision, device)]


@torch.no_grad()
def baseline_features(model: MLSTM, texts: list[str], device: torch.device, precision: str) -> np.ndarray:
    """The named baseline: each text alone, batch of 1, through ``model(bytes[None])``; its final c."""
    features_NH = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    for n, text in enumerate(texts):
        bytes_T = torch.frombuffer(bytearray(encode(text)), dtype=torch.uint8).long().to(device)
        with autocast(device, resolve_precision(precision, device)):
            _, (_, c_1H), _ = model(bytes_T[None])
        features_NH[n] = c_1H[0].float().cpu().numpy()
    return features_NH


def max_relative_difference(fast_NH: np.ndarray, baseline_NH: np.ndarray) -> float:
    scale_N = np.abs(baseline_NH).max(axis=1)
    return float((np.abs(fast_NH - baseline_NH).max(axis=1) / np.maximum(scale_N, 1e-30)).max())


def feature_row(
    name: str,
    pool: list[str],
    n_fast: int,
    n_baseline: int,
    batch_size: int | None,
    device: torch.device,
    precision: str = "auto",
) -> tuple[FeatureRow, np.ndarray]:
    """The row, and the fast path's features (for the comparison across precisions)."""
    torch.manual_seed(0)
    model = MLSTM(preset(name)).to(device).eval()
    reference = MLSTM(model.config, recurrence="reference").to(device).eval()
    reference.load_state_dict(model.state_dict())
    dtype = resolve_precision(precision, device)
    rows = batch_size or rows_for_memory(model, device, dtype=dtype)
    fast_texts, baseline_texts = take(pool, n_fast), take(pool, n_baseline)
    # Warm-up for all three (kernels, compilation, autocast, allocator): a few texts, not timed.
    warm = sorted(fast_texts, key=len)[:8]
    featurize(model, warm, batch_size=rows, device=device, precision=precision)
    featurize(reference, warm[:2], batch_size=rows, device=device, precision=precision)
    baseline_features(model, warm[:2], device, precision)

    say(f"  {name}: fast path, {n_fast} texts in batches of {rows} …")
    synchronize(device)
    started = time.perf_counter()
    fast_NH = featurize(model, fast_texts, batch_size=rows, device=device, precision=precision)
    synchronize(device)
    seconds = time.perf_counter() - started

    say(f"  {name}: reference recurrence, {n_fast} texts in batches of {rows} …")
    synchronize(device)
    started = time.perf_counter()
    reference_NH = featurize(reference, fast_texts, batch_size=rows, device=device, precision=precision)
    synchronize(device)
    reference_seconds = time.perf_counter() - started

    say(f"  {name}: baseline, {n_baseline} texts one at a time …")
    synchronize(device)
    started = time.perf_counter()
    baseline_NH = baseline_features(model, baseline_texts, device, precision)
    synchronize(device)
    baseline_seconds = time.perf_counter() - started

    # Parity on every text the baseline read; the fast path's feature of a text does not depend on its batch.
    compare = min(n_fast, n_baseline)
    extra = featurize(model, baseline_texts[compare:], batch_size=rows, device=device, precision=precision)
    diff = max_relative_difference(np.concatenate([fast_NH[:compare], extra]), baseline_NH)
    diff = max(diff, max_relative_difference(fast_NH, reference_NH))

    lengths = np.array([len(encode(t)) for t in fast_texts])
    chars = int(lengths.sum())
    held = sum(len(batch) * int(lengths[batch].max()) for batch in length_batches(lengths.tolist(), rows))
    packing = pack(lengths.tolist(), rows)
    row_steps = len(packing.row_steps_S) * packing.steps
    baseline_chars = sum(len(encode(t)) for t in baseline_texts)
    precision = PRECISION_NAMES[dtype]
    row = FeatureRow(
        preset=name,
        num_params=model.config.num_params,
        device=str(device),
        precision=precision,
        batch_size=rows,
        batch_sized_by="--batch-size" if batch_size else "memory",
        texts=n_fast,
        chars=chars,
        padding=(held - chars) / held,
        rows=len(packing.row_steps_S),
        steps=packing.steps,
        idle=(row_steps - chars) / row_steps,
        seconds=seconds,
        chars_per_s=chars / seconds,
        reference_seconds=reference_seconds,
        reference_chars_per_s=chars / reference_seconds,
        vs_reference=reference_seconds / seconds,
        baseline_texts=n_baseline,
        baseline_chars=baseline_chars,
        baseline_seconds=baseline_seconds,
        baseline_chars_per_s=baseline_chars / baseline_seconds,
        ratio=(chars / seconds) / (baseline_chars / baseline_seconds),
        max_rel_diff=diff,
        tolerance=TOLERANCE[precision],
    )
    del model, reference
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, fast_NH


def profile_features(
    name: str, texts: list[str], batch_size: int | None, device: torch.device, path: Path
) -> None:
    """featurize of ``texts`` under torch.profiler after a warm-up on them; operators by device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = MLSTM(preset(name)).to(device).eval()
    rows = batch_size or rows_for_memory(model, device)
    featurize(model, texts, batch_size=rows, device=device)  # compilation and the allocator stay out
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    started = time.perf_counter()
    with profile(activities=activities) as profiler:
        featurize(model, texts, batch_size=rows, device=device)
        synchronize(device)
    seconds = time.perf_counter() - started
    lengths = [len(encode(t)) for t in texts]
    chars = sum(lengths)
    packing = pack(lengths, rows)
    text = profile_table(profiler, device)
    header = (
        f"{name} featurize on {device}: {len(texts)} texts, {chars:,} chars (longest {max(lengths):,}), "
        f"packed into {len(packing.row_steps_S)} rows × {packing.steps:,} steps, {seconds:.3f} s profiled, "
        f"{chars / seconds:,.0f} chars/s"
    )
    path.write_text(header + "\n" + text + "\n")
    say(f"profile of featurize written to {path}")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Served-model latency


@dataclass
class ServeRow:
    preset: str
    batch: int  # texts per request
    requests: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    per_text_ms: float  # p50 ÷ batch
    device: str = "cpu"  # models/serving.py loads the classifier on the CPU
    precision: str = "auto"  # the requests' precision parameter (auto: none sent)
    latencies_ms: list[float] = field(default_factory=list)


@contextlib.contextmanager
def served_model(name: str, scratch: Path) -> Iterator[str]:
    """Log a random-weight classifier of the preset to a temporary store, serve it; yields its base URL."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow
    from mlflow.tracking import MlflowClient

    from models.classifier import SentimentClassifier
    from tasks.transfer.registry import log_classifier

    tracking_uri = f"sqlite:///{scratch}/mlflow.db"
    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri)
    experiment_id = client.create_experiment(
        "features-benchmark", artifact_location=(scratch / "artifacts").as_uri()
    )
    run_id = client.create_run(experiment_id, run_name=f"serve-{name}").info.run_id
    torch.manual_seed(0)
    model = MLSTM(preset(name))
    coef_H = np.random.default_rng(0).normal(0, model.config.hidden_size**-0.5, model.config.hidden_size)
    classifier = SentimentClassifier(model, coef_H, 0.0, {"benchmark": "random weights"})
    say(f"serving: logging a {name} classifier (random weights) to {tracking_uri} …")
    model_uri = log_classifier(run_id, classifier, "classifier")
    client.set_terminated(run_id)
    del classifier, model

    from tasks.transfer.serve import served

    say(f"serving: mlflow models serve -m {model_uri} --env-manager local --workers 1")
    with served(model_uri, tracking_uri, log=scratch / "server.log", timeout=SERVE_TIMEOUT_S) as url:
        yield url


def time_requests(
    url: str, texts: list[str], requests: int, warmup: int, precision: str = "auto"
) -> list[float]:
    """Milliseconds of each timed POST /invocations of these texts (one request each time), the model read
    in ``precision`` (auto: the served model's default, no parameter sent)."""
    import httpx

    body: dict[str, Any] = {"dataframe_records": [{"text": text} for text in texts]}
    if precision != "auto":
        body["params"] = {"precision": precision}
    latencies = []
    with httpx.Client(timeout=600) as client:
        for i in range(warmup + requests):
            started = time.perf_counter()
            response = client.post(f"{url}/invocations", json=body)
            elapsed = time.perf_counter() - started
            if response.status_code != 200:
                raise RuntimeError(f"POST /invocations: {response.status_code} {response.text[:500]}")
            predictions = response.json()["predictions"]
            if len(predictions) != len(texts):
                raise RuntimeError(
                    f"POST /invocations: {len(predictions)} predictions for {len(texts)} texts"
                )
            if i >= warmup:
                latencies.append(elapsed * 1000)
    return latencies


def serve_rows(args: argparse.Namespace, pool: list[str]) -> list[ServeRow]:
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="mlstm-bench-serve-") as scratch,
        served_model(args.serve_preset, Path(scratch)) as url,
    ):
        for precision in args.precisions:
            for batch in (1, args.serve_batch):
                say(
                    f"serving: {args.requests} requests of {batch} text(s) in {precision}, "
                    f"after {args.warmup_requests} warm-up …"
                )
                latencies = time_requests(
                    url, take(pool, batch), args.requests, args.warmup_requests, precision
                )
                p50, p99 = (float(v) for v in np.percentile(latencies, [50, 99]))
                rows.append(
                    ServeRow(
                        preset=args.serve_preset,
                        batch=batch,
                        requests=args.requests,
                        p50_ms=p50,
                        p99_ms=p99,
                        mean_ms=float(np.mean(latencies)),
                        per_text_ms=p50 / batch,
                        precision=precision,
                        latencies_ms=latencies,
                    )
                )
    return rows


# ---------------------------------------------------------------------------------------------
# Report


def print_report(
    features: list[FeatureRow], serving: list[ServeRow], info: dict[str, Any], source: str, file: Any
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=None if file.isatty() else 200)
    where = info.get("gpu") or f"{info['cores']} cores ({info['cpu']}), {info['torch_threads']} torch threads"
    console.print(f"{where}, torch {info['torch']}; texts: {source}; random-init weights", highlight=False)
    table = Table(
        title="Feature extraction: featurize (texts packed end to end) vs the reference recurrence "
        "(length-bucketed batches) and one text at a time"
    )
    columns = ("preset", "device", "precision", "batch", "texts", "chars", "rows × steps", "idle", "padding")
    columns += ("fast chars/s",)
    columns += ("reference chars/s", "fast ÷ reference", "baseline texts", "baseline chars/s")
    columns += ("fast ÷ baseline", "max rel diff")
    for column in columns:
        table.add_column(column, justify="left" if column in ("preset", "device", "precision") else "right")
    for r in features:
        table.add_row(
            r.preset,
            r.device,
            r.precision,
            f"{r.batch_size} ({r.batch_sized_by})",
            str(r.texts),
            f"{r.chars:,}",
            f"{r.rows} × {r.steps:,}",
            f"{r.idle:.1%}",
            f"{r.padding:.1%}",
            f"{r.chars_per_s:,.0f}",
            f"{r.reference_chars_per_s:,.0f}",
            f"{r.vs_reference:.2f}",
            str(r.baseline_texts),
            f"{r.baseline_chars_per_s:,.0f}",
            f"{r.ratio:.2f}",
            f"{r.max_rel_diff:.1e}",
        )
    console.print(table)
    for r in features:
        if r.vs_first_precision is not None:
            first = next(f for f in features if f.preset == r.preset)
            console.print(precision_line(asdict(r), asdict(first)), highlight=False)
    if serving:
        table = Table(title="Served model: POST /invocations (mlflow models serve, 1 worker, CPU)")
        columns = (
            "preset",
            "precision",
            "batch",
            "requests",
            "p50 ms",
            "p99 ms",
            "mean ms",
            "ms per text (p50)",
        )
        for column in columns:
            table.add_column(column, justify="left" if column in ("preset", "precision") else "right")
        for s in serving:
            table.add_row(
                s.preset,
                s.precision,
                str(s.batch),
                str(s.requests),
                f"{s.p50_ms:,.1f}",
                f"{s.p99_ms:,.1f}",
                f"{s.mean_ms:,.1f}",
                f"{s.per_text_ms:,.2f}",
            )
        console.print(table)


def check(features: list[FeatureRow]) -> list[str]:
    return [
        f"{r.preset}: fast and baseline features differ by {r.max_rel_diff:.2e} (relative; tolerance "
        f"{r.tolerance:g} in {r.precision})"
        for r in features
        if not r.max_rel_diff <= r.tolerance
    ]


# ---------------------------------------------------------------------------------------------
# Main


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = new_parser(
        (
            "Benchmark feature extraction (chars/s of featurize against one text at a time through the "
            "same model) and the served model's latency (p50/p99 of POST /invocations)."
        ),
    )
    parser.add_argument(
        "--presets", default="small,paper_4096", help=f"Comma-separated, of {', '.join(PRESETS)}."
    )
    parser.add_argument(
        "--data",
        type=Path,
        help=(
            f"CSV (or .csv.gz) of texts: a sentence, text or review column (default: {DEFAULT_DATA} on a "
            f"CPU, {DEFAULT_GPU_DATA} on a GPU; the project's generated sample when that is absent)."
        ),
    )
    parser.add_argument("--texts", type=int, help="Texts for the fast path (default: by preset and device).")
    parser.add_argument(
        "--baseline-texts", type=int, help="Texts for the baseline (default: by preset and device)."
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="featurize's rows per batch at most (default: as many as fit half the device's free memory).",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--precisions",
        default="auto",
        help="Comma-separated, of auto, bf16, fp16, fp32: each preset once in each, compared with the first "
        "(auto: bf16 or fp16 on a GPU, fp32 on a CPU).",
    )
    parser.add_argument("--serve-preset", default="small", help="Preset of the served classifier.")
    parser.add_argument("--serve-batch", type=int, default=64, help="Texts per request of the batch row.")
    parser.add_argument(
        "--requests",
        type=int,
        help=f"Timed requests per batch size (default: {GPU_REQUESTS} with a GPU, {CPU_REQUESTS} without).",
    )
    parser.add_argument("--warmup-requests", type=int, default=2, help="Requests before the timed ones.")
    parser.add_argument(
        "--serve", action=argparse.BooleanOptionalAction, default=True, help="Also time the served model."
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        dest="json_path",
        metavar="PATH",
        help="Print the results as JSON on stdout (the tables then go to stderr), or write them to PATH.",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="PATH",
        help="Also profile featurize on the first preset (torch.profiler, 128 of the texts, after a warm-up) "
        "and write its operators by device time to PATH: where a goal is missed, where the time goes.",
    )
    add_record_option(parser)
    args = parser.parse_args(argv)
    args.presets = _names(args.presets)
    args.precisions = _names(args.precisions)
    if bad := [p for p in args.precisions if p not in PRECISION_CHOICES]:
        parser.error(f"--precisions: {', '.join(bad)} is not one of {', '.join(PRECISION_CHOICES)}")
    for name in (*args.presets, args.serve_preset):
        if name not in PRESETS:
            parser.error(f"unknown preset {name!r}: choose from {', '.join(PRESETS)}")
    for flag in ("texts", "baseline_texts", "batch_size", "serve_batch", "requests"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup_requests < 0:
        parser.error("--warmup-requests must not be negative")
    if args.data is not None and not args.data.exists():
        parser.error(f"--data: {args.data} does not exist")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    return args


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    info = machine(device)
    data = args.data or (DEFAULT_GPU_DATA if cuda else DEFAULT_DATA)
    if data.exists():
        pool, source = load_texts(data), str(data)
    else:
        say(
            f"{data} is absent: using the project's generated sample (tasks.corpus.sample.write_labelled_sample)"
        )
        pool, source = generated_texts(), f"generated sample (tasks.corpus.sample; {data} absent)"
    random.Random(0).shuffle(pool)  # files are often sorted by label; the same order every run
    counts = GPU_COUNTS if cuda else CPU_COUNTS
    batch_size = args.batch_size

    features = []
    for name in args.presets:
        n_fast = args.texts or counts[name][0]
        n_baseline = args.baseline_texts or counts[name][1]
        first: tuple[FeatureRow, np.ndarray] | None = None
        for precision in args.precisions:
            say(
                f"{name} on {device} ({precision_of(device, precision)}): {n_fast} texts, "
                f"baseline {n_baseline} …"
            )
            row, fast_NH = feature_row(name, pool, n_fast, n_baseline, batch_size, device, precision)
            if first is None:
                first = row, fast_NH
            else:
                row.vs_first_precision = row.chars_per_s / first[0].chars_per_s
                row.first_precision_rel_diff = max_relative_difference(fast_NH, first[1])
            features.append(row)
    if args.profile:
        profile_features(args.presets[0], take(pool, 128), batch_size, device, args.profile)
    args.requests = args.requests or (GPU_REQUESTS if cuda else CPU_REQUESTS)
    serving = serve_rows(args, pool) if args.serve else []
    return {
        "machine": info,
        "command": shlex.join(
            ["python", "benchmarks/features.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "settings": {
            "presets": args.presets,
            "device": str(device),
            "precisions": args.precisions,
            "batch_size": batch_size,
            "serve_preset": args.serve_preset if args.serve else None,
            "serve_batch": args.serve_batch,
            "requests": args.requests,
            "warmup_requests": args.warmup_requests,
        },
        "texts_source": source,
        "texts_available": len(pool),
        "weights": "random init (torch seed 0; probe numpy seed 0)",
        "features": [asdict(row) for row in features],
        "serving": [asdict(row) for row in serving],
        "checks_failed": check(features),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    to_stdout = args.json_path == "-"
    # With JSON on stdout, anything else printed (ours, MLflow's) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        report = run(args, argv)
        print_report(
            [FeatureRow(**r) for r in report["features"]],
            [ServeRow(**r) for r in report["serving"]],
            report["machine"],
            report["texts_source"],
            sys.stdout,
        )
        for problem in report["checks_failed"]:
            print(f"CHECK FAILED: {problem}", file=sys.stderr)
    text = json.dumps(report, indent=2) + "\n"
    if to_stdout:
        sys.stdout.write(text)
    elif args.json_path:
        Path(args.json_path).write_text(text)
    record("features", args.record, report, argv=argv)
    return 1 if report["checks_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
