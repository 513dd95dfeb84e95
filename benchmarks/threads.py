#!/usr/bin/env python
"""Torch threads against the work and the cores: steps/s at 1 and 2 threads, quiet and with a core busy.

Rows, each timed for ``--seconds`` after a warm-up, at every thread count of ``--threads``:

- tiny, small: the job's training step (``tasks.pretrain.step.optimizer_step``: autocast, cross-entropy,
  clipping, Adam) of that preset on random bytes, the state carried from step to step; tiny at the
  demo's shape (16 rows × 64 bytes), small at ``--small-batch`` rows (a step of small is about a second);
- tiny features: the features path (``models.features.featurize``) of tiny over 256 texts of 64 letters, as
  the transfer stage and a scoring worker read reviews;
- matmul 64: a loop of 64 × 64 matrix products, the size of tiny's recurrent products.

Each runs twice: quiet (whatever else the machine runs), then with one core kept busy by a spinning
process this script starts and stops. The baseline is 2 threads (torch's default on 2 cores) in the same
condition of the same run: ``vs 2 threads`` is a row's steps/s over that one's. The rule these numbers
set is ``tasks/jobs/threads.py``; the recorded figures are in docs/benchmarks.md.

    PYTHONPATH=. .venv/bin/python benchmarks/threads.py                 # about a minute
    PYTHONPATH=. .venv/bin/python benchmarks/threads.py --rows tiny,matmul --seconds 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from common import add_record_option, machine, new_parser, record, say  # the working tree on the path

from models.features import featurize
from models.mlstm import MLSTM, preset
from tasks.pretrain.step import optimizer_step

ROWS = ("tiny", "small", "tiny features", "matmul 64")


@dataclass
class Row:
    work: str
    condition: str  # quiet | one core busy
    threads: int
    steps: int
    seconds: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds


def training_step(name: str, batch: int, seq_len: int) -> Callable[[], None]:
    """One training step of the preset per call, the state carried on."""
    torch.manual_seed(0)
    model = MLSTM(preset(name))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = [model.zero_state(batch)]

    def step() -> None:
        bytes_BT = torch.randint(0, 256, (batch, seq_len + 1))
        _, state[0], _ = optimizer_step(
            model,
            optimizer,
            scaler,
            bytes_BT[:, :-1],
            bytes_BT[:, 1:],
            state[0],
            dtype=torch.float32,
            clip=1.0,
        )

    return step


def features_pass(name: str, batch: int, seq_len: int) -> Callable[[], None]:
    """The features path (``models.features.featurize``) over ``batch`` texts of ``seq_len`` letters."""
    torch.manual_seed(0)
    model = MLSTM(preset(name))
    texts = ["".join(chr(97 + int(i)) for i in torch.randint(0, 26, (seq_len,))) for _ in range(batch)]

    def step() -> None:
        featurize(model, texts, batch_size=batch)

    return step


def matmul_loop(width: int, products: int = 100) -> Callable[[], None]:
    """``products`` chained products with a width × width matrix per call (one step)."""
    a_WW, b_WW = torch.randn(width, width), torch.randn(width, width) / width

    def step() -> None:
        x_WW = a_WW
        for _ in range(products):
            x_WW = x_WW @ b_WW

    return step


def work_of(name: str, args: argparse.Namespace) -> Callable[[], None]:
    if name == "tiny":
        return training_step("tiny", 16, 64)
    if name == "small":
        return training_step("small", args.small_batch, 64)
    if name == "tiny features":
        return features_pass("tiny", 256, 64)
    return matmul_loop(64)


def timed(step: Callable[[], None], seconds: float, warmup: int = 1, min_steps: int = 2) -> tuple[int, float]:
    for _ in range(warmup):
        step()
    steps, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or steps < min_steps:
        step()
        steps += 1
    return steps, elapsed


@contextlib.contextmanager
def one_core_busy(busy: bool) -> Iterator[None]:
    """A process spinning on one core for the block's length (started and stopped here), or nothing."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # scheduled before the clock starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


def measure(args: argparse.Namespace) -> list[Row]:
    rows = []
    for work in args.rows:
        for condition, busy in (("quiet", False), ("one core busy", True)):
            with one_core_busy(busy):
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    steps, seconds = timed(work_of(work, args), args.seconds)
                    rows.append(Row(work, condition, threads, steps, seconds))
                    say(f"  {work}, {condition}, {threads} threads: {steps / seconds:,.1f} steps/s")
    return rows


def print_table(rows: list[Row]) -> None:
    base = {(r.work, r.condition): r.steps_per_s for r in rows if r.threads == 2}
    print(f"{'work':<14} {'condition':<14} {'threads':>7} {'steps':>6} {'steps/s':>10} {'vs 2 threads':>13}")
    for r in rows:
        ratio = (
            f"{r.steps_per_s / base[(r.work, r.condition)]:.2f}×" if (r.work, r.condition) in base else "—"
        )
        print(
            f"{r.work:<14} {r.condition:<14} {r.threads:>7} {r.steps:>6} {r.steps_per_s:>10,.1f} {ratio:>13}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"Comma-separated, of: {', '.join(ROWS)}.")
    parser.add_argument("--threads", default="1,2", help="Comma-separated torch thread counts.")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="Timed seconds per row (at least 2 steps)."
    )
    parser.add_argument("--small-batch", type=int, default=2, help="Rows of a small step (64 bytes each).")
    add_record_option(parser)
    args = parser.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",")]
    if unknown := set(args.rows) - set(ROWS):
        parser.error(f"--rows: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ROWS)}")
    args.threads = [int(t) for t in args.threads.split(",")]
    info = machine(torch.device("cpu"))  # torch's own thread count, before the rows set theirs
    load_before = os.getloadavg()[0]
    rows = measure(args)
    print_table(rows)
    print(f"load average (1 min): {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    results = {
        "machine": info,
        "settings": {"seconds": args.seconds, "small_batch": args.small_batch},
        # Other processes' load: on a shared machine "quiet" means only that this run added none.
        "load_average": [load_before, os.getloadavg()[0]],
        "rows": [asdict(r) | {"steps_per_s": r.steps_per_s} for r in rows],
    }
    record("threads", args.record, results)


if __name__ == "__main__":
    main()
