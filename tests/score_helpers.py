"""Helpers of the score tests. A scoring run's: the IMDB slice's rows and the score flow as the CLI runs
it (``test_score.py``, ``test_score_workers.py``; the champion and slice fixtures are in conftest.py). The
readers': input files of multi-line texts and blank lines, and their rows read by window or whole
(``test_score_inputs.py``, ``test_score_read_costs.py``, ``test_score_s3_inputs.py``)."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from tasks.score import inputs

SLICE_ROWS = 240  # every 100th review of IMDB test: both labels, lengths as they come
PIECE_ROWS = 64  # four pieces, the last one short


def imdb_rows(path: Path, every: int, limit: int) -> list[dict[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as stream:
        return [row for i, row in enumerate(csv.DictReader(stream)) if i % every == 0][:limit]


def run_scoring(inputs: list[str], output: str, **options: Any) -> dict[str, Any]:
    """The score flow as the CLI runs it, on threads unless the test names its task runner: a process
    pool's worker imports torch, Prefect and MLflow first (5-8 s of CPU), and only the tests of the
    runners are about it (``scored``, the killed run, Dask against the pool)."""
    import torch

    from flows.cli.score import run_score

    options.setdefault("task_runner", "thread")
    options.setdefault("piece_rows", PIECE_ROWS)
    threads = torch.get_num_threads()
    try:
        return run_score(inputs, output=output, show_progress=False, **options).model_dump()
    finally:
        torch.set_num_threads(threads)  # a thread worker sets this process's


ROWS = 3000  # three offsets at OFFSET_ROWS 1,024


def write_csv(path: Path) -> Path:
    """Quoted texts over several lines, doubled quotes, and empty lines pyarrow skips."""
    lines = ["id,text,extra"]
    for i in range(ROWS):
        text = f'"a review over\nlines, ""quoted"" {i}"' if i % 3 == 0 else f"plain review {i}"
        lines.append(f"{i},{text},x{i % 7}")
        if i % 500 == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_jsonl(path: Path) -> Path:
    """Blank lines (no row) and a line that is not JSON (a row, rejected later)."""
    lines = []
    for i in range(ROWS):
        lines.append(json.dumps({"id": i, "text": f"review {i} " * (i % 5 + 1)}) if i % 700 else "{not json")
        if i % 400 == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def read_window(file: inputs.InputFile, start: int, stop: int) -> pa.Table:
    return inputs.read_rows(file, start, stop, text_column="text", id_columns=["id"])


def read_whole(file: inputs.InputFile) -> pa.Table:
    batches = inputs.read_batches(file.uri, file.format, text_column="text", id_columns=["id"])
    return pa.Table.from_batches(list(batches)).combine_chunks()
