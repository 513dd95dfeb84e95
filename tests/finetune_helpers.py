"""Data and a checkpoint for fine-tuning tests: labels an early byte decides, the tiny mLSTM's weights."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import torch


def write_split(path: Path, rows: list[tuple[str, int]], header: tuple[str, ...] = ("text", "label")) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)


def early_byte_rows(count: int, rng: random.Random) -> list[tuple[str, int]]:
    rows = []
    for _ in range(count):
        label = rng.randint(0, 1)
        tail = "".join(rng.choice("cdefghijklmnopqrstuvwxyz ") for _ in range(40))
        rows.append((f"{'ab'[label]} {tail}", label))
    return rows


def tiny_checkpoint(store: Path) -> str:
    """The tiny mLSTM's initial weights, saved as a pretraining checkpoint."""
    from models.mlstm import MLSTM, tiny
    from tasks.jobs.checkpoint import save_checkpoint
    from tasks.store import open_store

    torch.manual_seed(0)
    model = MLSTM(tiny())
    meta = {
        "model": {k: getattr(model.config, k) for k in ("hidden_size", "embed_size", "vocab_size")},
        "config": {},
        "total_steps": 1,
    }
    return save_checkpoint(open_store(str(store)), "tiny", 0, {"model": model.state_dict()}, meta)


def early_byte_splits(folder: Path, seed: int = 0) -> Path:
    """train/dev/test CSVs (256/128/128 rows) of early-byte rows, in ``folder``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 256), ("dev", 128), ("test", 128)):
        write_split(folder / f"{split}.csv", early_byte_rows(count, rng))
    return folder
