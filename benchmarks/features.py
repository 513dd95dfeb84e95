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

This file is the command: its arguments, the run, the report and its check. The texts are read in
``benchmarks/features_texts.py``, the feature rows measured in ``benchmarks/features_throughput.py``,
the served model timed in ``benchmarks/features_serve.py``.

    PYTHONPATH=. .venv/bin/python benchmarks/features.py                    # defaults picked by device
    PYTHONPATH=. .venv/bin/python benchmarks/features.py --presets tiny --texts 32 --baseline-texts 8 \\
        --requests 3 --serve-preset tiny --json                             # JSON on stdout, tables on stderr
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (  # the working tree on the path
    add_record_option,
    machine,
    new_parser,
    precision_line,
    record,
    say,
)
from features_serve import ServeRow, serve_rows
from features_texts import DEFAULT_DATA, DEFAULT_GPU_DATA, generated_texts, load_texts, take
from features_throughput import (
    FeatureRow,
    feature_row,
    max_relative_difference,
    precision_of,
    profile_features,
)

from models.mlstm import PRESETS
from models.precision import PRECISION_CHOICES

# (texts for the fast path, texts for the baseline) per preset, when --texts / --baseline-texts are not
# given. The CPU ones finish in a few minutes in all on 2 cores (paper_4096 is ~170 MFLOP per byte): 64
# texts make one full batch, where batching starts to pay on a CPU.
CPU_COUNTS = {"tiny": (512, 64), "small": (256, 32), "paper_4096": (64, 4), "paper_8192": (16, 1)}
# On a GPU one text at a time is launch-bound (an H200 read 4.8k chars/s of IMDB that way at paper_4096):
# a few dozen texts give its rate; more only lengthen the run.
GPU_COUNTS = {"tiny": (2048, 256), "small": (2048, 128), "paper_4096": (2048, 32), "paper_8192": (2048, 16)}
CPU_REQUESTS, GPU_REQUESTS = 20, 50  # a request of 64 texts of `small` takes seconds on 2 CPU cores


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
