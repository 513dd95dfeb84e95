"""The texts ``benchmarks/features.py`` reads, and where they come from.

A CSV of the shared data (SST-2 test sentences on a CPU, IMDB test reviews on a GPU, or ``--data``), or
the project's generated labelled sample where that is absent; ``take`` deals them out to the feature
rows and the served model's requests alike.
"""

from __future__ import annotations

import csv
import gzip
import os
import tempfile
from pathlib import Path
from typing import Any

from common import REPO  # the working tree on the path

# The shared data beside the checkout, or where MLSTM_SHARED_DIR says (a worktree elsewhere).
SHARED_DATA = Path(os.environ.get("MLSTM_SHARED_DIR", REPO.parent / "shared")) / "data"
DEFAULT_DATA = SHARED_DATA / "sst2" / "test_binary_sent.csv"
DEFAULT_GPU_DATA = SHARED_DATA / "imdb" / "test.csv.gz"
TEXT_COLUMNS = ("sentence", "text", "review")


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
