#!/usr/bin/env python
"""Does the project's own pretraining learn sentiment? The first learning curve on real review text.

    make gpu-learn             # PYTHONPATH=. python3 benchmarks/gpu_learn.py --record  (one GPU, ≤ 5 min)
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_learn.py --preset tiny --batch 8 --seq-len 32 \\
        --max-steps 6 --points 2 --json learn.json                                   # seconds, CPU

paper_4096 in bf16 (``--preset``, ``--precision``) trains on the bundle ``benchmarks/pack_gpu_data.py``
packs into ``.gpu-data/`` (the shared Amazon reviews and IMDB's unlabelled reviews as one byte stream;
carried to the lent machine with ``carry: [".gpu-data"]``), and at the untrained start and at
``--points`` points along the way it reads:

- the validation bits per byte (``--val-bytes`` of held-out reviews, ``--val-rows`` rows reading on,
  the state carried from chunk to chunk as in training);
- the features of SST and of the bundle's IMDB slice (``models.features.featurize``, the transfer
  stage's path) and the L1 probe on them (``tasks.transfer.solvers.newton``'s path over ``--cs``, C
  chosen on dev), with its test accuracy, its non-zero weights and its top unit's accuracy alone.

Training is the job's step: the whole step one CUDA graph on a GPU (``tasks.pretrain.graphed``,
Adam fused and capturable), the eager step elsewhere (``tasks.pretrain.step.optimizer_step``, its
twin); ``--batch`` rows each read their own stretch of the stream, the state carried across steps
(truncated BPTT), Adam at ``--lr`` warmed up over ``--warmup-steps`` and decayed linearly to zero
(the papers' schedule). The steps are planned from the time left: the untrained point is read first,
and the steps that fit ``--train-s`` (and ``--budget`` for the whole) are taken at the step time
measured on the first ``TIMED_STEPS``, each later read planned at what the untrained one cost, but no
more than ``--point-s`` (the untrained one compiled the reading kernels); after each read the plan is
made again with what that read cost. ``--max-steps`` fixes the number instead.

Runs with torch and numpy (and numba and scipy, the newton solver's) from the working tree: no
pydantic, Prefect or MLflow. ``--record`` writes ``benchmarks/results/gpu-learn.json``, rendered in
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import REPO, machine, new_parser, record, say, synchronize  # the working tree on the path
from torch.nn import functional as F

from models.config import PRESETS, preset
from models.features import featurize
from models.mlstm import MLSTM, State
from models.precision import PRECISION_NAMES, autocast, resolve_precision
from tasks.pretrain.graphed import GraphedStep
from tasks.pretrain.step import optimizer_step
from tasks.transfer.solvers.newton import l1_logistic_path

BUDGET_S = 300  # issue 54: the learning part in at most 5 minutes on one GPU
TIMED_STEPS = 10  # steps timed to plan the rest
START_S = 30  # what the plan keeps beside the reads: the results, and a read slower than planned
DEFAULT_CS = ",".join(f"{2.0**k:g}" for k in range(-8, 3))  # the transfer stage's: 2^-8 … 2^2


@dataclasses.dataclass
class Bundle:
    train: np.ndarray  # uint8, the training stream
    val: np.ndarray  # uint8, the validation stream
    probes: dict[str, dict[str, dict[str, list[Any]]]]  # dataset → split → text, label
    manifest: dict[str, Any]


def load_bundle(folder: Path) -> Bundle:
    """The packed bundle, its streams decompressed; one line naming what is missing if it is not there."""
    needed = ["train.u8.xz", "val.u8.xz", "probes.json.xz", "manifest.json"]
    if missing := [name for name in needed if not (folder / name).is_file()]:
        raise FileNotFoundError(
            f"--data {folder}: no {', '.join(missing)} (pack it with benchmarks/pack_gpu_data.py, and "
            "carry .gpu-data to the GPU machine)"
        )

    def stream(name: str) -> np.ndarray:
        return np.frombuffer(lzma.decompress((folder / name).read_bytes()), dtype=np.uint8)

    probes = json.loads(lzma.decompress((folder / "probes.json.xz").read_bytes()))
    manifest = json.loads((folder / "manifest.json").read_text())
    return Bundle(stream("train.u8.xz"), stream("val.u8.xz"), probes, manifest)


class Stream:
    """``rows`` rows, each reading its own contiguous stretch of the stream, ``seq_len`` bytes a step
    (and the next byte as the last target); a row wraps to its stretch's start at its end."""

    def __init__(self, data: np.ndarray, rows: int, seq_len: int, device: torch.device) -> None:
        self.stretch = len(data) // rows
        if self.stretch < seq_len + 2:
            raise ValueError(f"{len(data):,} training bytes are too few for {rows} rows of {seq_len}")
        self.data = torch.from_numpy(data.copy()).to(device)
        self.starts_B1 = torch.arange(rows, device=device)[:, None] * self.stretch
        self.offsets_1T = torch.arange(seq_len + 1, device=device)[None, :]
        self.seq_len, self.steps_per_pass = seq_len, (self.stretch - 1) // seq_len

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = (step % self.steps_per_pass) * self.seq_len
        bytes_BT = self.data[self.starts_B1 + at + self.offsets_1T].long()
        return bytes_BT[:, :-1], bytes_BT[:, 1:]


@torch.no_grad()
def val_bits_per_byte(
    model: MLSTM, val: np.ndarray, rows: int, seq_len: int, max_bytes: int, dtype: torch.dtype
) -> float:
    """Cross-entropy in bits per byte over the first ``max_bytes`` of the validation stream, read as
    ``rows`` rows, the state carried from chunk to chunk."""
    device = next(model.parameters()).device
    length = min(len(val), max_bytes) // rows
    if length < 2:
        raise ValueError(f"{len(val):,} validation bytes are too few for {rows} rows")
    bytes_BL = torch.from_numpy(val[: rows * length].copy()).to(device).long().view(rows, length)
    state: State | None = None
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    for start in range(0, length - 1, seq_len):
        chunk = bytes_BL[:, start : start + seq_len + 1]
        with autocast(device, dtype):
            logits, state, _ = model(chunk[:, :-1], state)
        total += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        count += chunk[:, 1:].numel()
    return float(total.item() / count / math.log(2))


def accuracy(X: np.ndarray, y: np.ndarray, coef: np.ndarray, intercept: float) -> float:
    return float(((X.astype(np.float64) @ coef + intercept > 0) == (y == 1)).mean())


def unit_alone(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """One unit as a classifier: the threshold and direction best on train, its test accuracy."""
    order = np.argsort(x_train)
    x, y = x_train[order], y_train[order]
    # Positives above each cut: ones at or above it; the best cut either way round.
    above = np.concatenate([np.cumsum(y[::-1])[::-1], [0]])
    below_negatives = np.concatenate([[0], np.cumsum(1 - y)])
    correct = above + below_negatives  # predict 1 above the cut
    both = np.maximum(correct, len(y) - correct)
    cut = int(np.argmax(both))
    sign = 1 if correct[cut] >= len(y) - correct[cut] else -1
    threshold = x[cut] if cut < len(x) else x[-1] + 1
    predicted = (x_test >= threshold) if sign > 0 else (x_test < threshold)
    return float((predicted == (y_test == 1)).mean())


def probe(
    features: dict[str, np.ndarray],
    labels: dict[str, np.ndarray],
    Cs: tuple[float, ...],
    device: torch.device,
) -> dict[str, Any]:
    """The L1 probe along ``Cs`` on train, C chosen on dev (ties to the smaller), scored on test."""
    points = list(l1_logistic_path(features["train"], labels["train"], Cs, device=device))
    dev = [accuracy(features["dev"], labels["dev"], p.coef, p.intercept) for p in points]
    best = points[int(np.argmax(dev))]
    unit = int(np.argmax(np.abs(best.coef)))
    return {
        "C": best.C,
        "dev_accuracy": max(dev),
        "test_accuracy": accuracy(features["test"], labels["test"], best.coef, best.intercept),
        "train_accuracy": accuracy(features["train"], labels["train"], best.coef, best.intercept),
        "nonzero": int(np.count_nonzero(best.coef)),
        "top_unit": unit,
        "top_unit_accuracy": unit_alone(
            features["train"][:, unit], labels["train"], features["test"][:, unit], labels["test"]
        ),
    }


def read_point(model: MLSTM, bundle: Bundle, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """Validation bits per byte, and each probe dataset's features and probe, with their seconds."""
    device = next(model.parameters()).device
    started = time.perf_counter()
    point: dict[str, Any] = {
        "val_bits_per_byte": val_bits_per_byte(
            model, bundle.val, args.val_rows, args.seq_len, args.val_bytes, dtype
        )
    }
    seconds = {"val": time.perf_counter() - started}
    for name, splits in bundle.probes.items():
        started = time.perf_counter()
        features = {
            split: featurize(model, data["text"], batch_size=None, precision=args.precision)
            for split, data in splits.items()
        }
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[f"{name}_features"] = time.perf_counter() - started
        started = time.perf_counter()
        labels = {split: np.asarray(data["label"]) for split, data in splits.items()}
        point[name] = probe(features, labels, args.cs, device)
        seconds[f"{name}_probe"] = time.perf_counter() - started
    model.train()
    return {**point, "seconds": seconds}


def trainer(
    model: MLSTM, stream: Stream, args: argparse.Namespace, dtype: torch.dtype
) -> tuple[Callable[[int, float], torch.Tensor], bool]:
    """One training step at a given step and learning rate, and whether it is captured."""
    device = next(model.parameters()).device
    captured = device.type == "cuda" and not args.eager
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if captured:  # lr a device tensor the schedule fills in place; torch captures only a capturable Adam
        optimizer = torch.optim.Adam(
            model.parameters(), lr=torch.tensor(args.lr, device=device), fused=True, capturable=True
        )
        graph = GraphedStep(
            model, optimizer, scaler, model.zero_state(args.batch), *stream.batch(0), dtype=dtype, clip=1.0
        )

        def captured_step(step: int, lr: float) -> torch.Tensor:
            for group in optimizer.param_groups:
                group["lr"].fill_(lr)
            return graph(*stream.batch(step))  # the loss, a tensor of its own

        return captured_step, True
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    carried = [model.zero_state(args.batch, device=device)]

    def eager_step(step: int, lr: float) -> torch.Tensor:
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, carried[0], _ = optimizer_step(
            model, optimizer, scaler, *stream.batch(step), carried[0], dtype=dtype, clip=1.0
        )
        return loss

    return eager_step, False


def plan(
    args: argparse.Namespace, began: float, step_s: float, reads: int, point_s: float, least: int
) -> int:
    """Steps that fit what the budget leaves (and --train-s), with ``reads`` reads of ``point_s`` to come."""
    left = args.budget - (time.perf_counter() - began) - reads * point_s - START_S
    return max(int(min(args.train_s, left) / step_s), least)


def learning_rate(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up over ``warmup`` steps, then linear decay towards zero at step ``total``: the
    warm-up does not depend on ``total``, so the plan can be made after the first steps."""
    return peak * min(1.0, (step + 1) / warmup) * min(1.0, (total - step) / max(total - warmup, 1))


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = resolve_precision(args.precision, device)
    bundle = load_bundle(args.data)
    say(f"bundle: {len(bundle.train) / 1e6:.1f} MB training text, {len(bundle.val) / 1e6:.2f} MB validation")
    torch.manual_seed(args.seed)
    model = MLSTM(preset(args.preset)).to(device)
    stream = Stream(bundle.train, args.batch, args.seq_len, device)
    chars_per_step = args.batch * args.seq_len

    points = [
        {
            "step": 0,
            "train_s": 0.0,
            "chars_seen": 0,
            "train_loss": None,
            **read_point(model, bundle, args, dtype),
        }
    ]
    point_s = sum(points[0]["seconds"].values())
    say(f"untrained: {summary(points[0])} ({point_s:.0f} s)")
    step_fn, captured = trainer(model, stream, args, dtype)

    # Time a few steps (at the warm-up's start), then plan the rest within --train-s and what the
    # budget leaves; with --max-steps, the plan is made first and the timed steps are its first.
    losses: list[torch.Tensor] = []
    # The smallest plan: each point after the timed steps, the decay after the warm-up.
    total = args.max_steps or max(TIMED_STEPS * args.points, 2 * args.warmup_steps)
    warmup = max(1, min(args.warmup_steps, total // 2))
    timed = min(TIMED_STEPS, max(1, total // args.points))
    synchronize(device)
    started = time.perf_counter()
    for step in range(timed):
        losses.append(step_fn(step, learning_rate(step, total, warmup, args.lr)))
    synchronize(device)
    train_s = time.perf_counter() - started
    step_s = train_s / timed
    # The untrained read compiled the reading kernels: later reads are taken to cost at most
    # --point-s, and the plan is made again after each with what that one cost.
    point_s = min(point_s, args.point_s)
    if not args.max_steps:
        total = max(plan(args, began, step_s, args.points, point_s, timed), total)
    marks = [max(timed, round(total * k / args.points)) for k in range(1, args.points + 1)]
    say(
        f"{'captured' if captured else 'eager'} step {step_s * 1e3:.1f} ms ({chars_per_step / step_s:,.0f} chars/s): "
        f"{total} steps, read at {', '.join(map(str, marks))}"
    )
    step = len(losses)
    for k in range(args.points):
        synchronize(device)
        started = time.perf_counter()
        while step < marks[k]:
            losses.append(step_fn(step, learning_rate(step, total, warmup, args.lr)))
            step += 1
        synchronize(device)
        train_s += time.perf_counter() - started
        recent = torch.stack(losses[-min(len(losses), 50) :]).float().mean().item()
        point = {
            "step": step,
            "train_s": train_s,
            "chars_seen": step * chars_per_step,
            "train_loss": recent,
            **read_point(model, bundle, args, dtype),
        }
        points.append(point)
        say(f"step {step} ({train_s / 60:.1f} min of training): {summary(point)}")
        left = args.points - k - 1
        if left and not args.max_steps:  # fewer steps if the reads cost more than planned
            point_s = sum(point["seconds"].values())
            total = max(min(total, step + plan(args, began, step_s, left, point_s, 0)), step + left)
            marks[k + 1 :] = [step + round((total - step) * j / left) for j in range(1, left + 1)]
    seconds = time.perf_counter() - began
    return {
        "machine": machine(device),
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("data", "json_path", "record", "cs")},
            "cs": list(args.cs),
            "precision": PRECISION_NAMES[dtype],
        },
        "data": {k: bundle.manifest[k] for k in ("reviews", "train_bytes", "val_bytes", "probes")},
        "captured": captured,
        "warmup_steps": warmup,  # as taken: at most half the steps
        "step_ms": step_s * 1e3,
        "chars_per_s": chars_per_step * step / train_s,
        "steps": step,
        "epochs": step * chars_per_step / len(bundle.train),
        "points": points,
        "seconds": seconds,
        "budget_s": args.budget,
        "within_budget": seconds <= args.budget,
    }


def summary(point: dict[str, Any]) -> str:
    probes = "; ".join(
        f"{name} {point[name]['test_accuracy']:.1%} (unit {point[name]['top_unit_accuracy']:.1%})"
        for name in ("sst", "imdb")
        if name in point
    )
    return f"val {point['val_bits_per_byte']:.3f} bits/byte; {probes}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--data", type=Path, default=REPO / ".gpu-data", help="The packed bundle's folder.")
    parser.add_argument("--preset", default="paper_4096", choices=sorted(PRESETS))
    parser.add_argument(
        "--precision", default="auto", help="auto (bf16 on a GPU that has it), bf16, fp16, fp32."
    )
    parser.add_argument("--batch", type=int, default=256, help="Rows per step.")
    parser.add_argument("--seq-len", type=int, default=256, help="Bytes per row per step (truncated BPTT).")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's peak learning rate.")
    parser.add_argument("--warmup-steps", type=int, default=50, help="Steps warming up (at most half).")
    parser.add_argument("--train-s", type=float, default=150.0, help="Seconds of training at most.")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="Seconds for the whole run.")
    parser.add_argument("--max-steps", type=int, default=0, help="Exactly this many steps (0: by time).")
    parser.add_argument("--points", type=int, default=3, help="Points read along the way (and at the start).")
    parser.add_argument(
        "--point-s", type=float, default=30.0, help="Seconds a read along the way is planned at, at most."
    )
    parser.add_argument("--val-rows", type=int, default=256, help="Rows reading the validation text.")
    parser.add_argument("--val-bytes", type=int, default=2**19, help="Validation bytes read at each point.")
    parser.add_argument("--cs", default=DEFAULT_CS, help="The probe's Cs, comma-separated.")
    parser.add_argument("--eager", action="store_true", help="The eager step even on a GPU.")
    parser.add_argument("--cpu", action="store_true", help="On the CPU even where a GPU is.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, dest="json_path", help="Also write the report to this file.")
    parser.add_argument(
        "--record", action="store_const", const="", help="Write benchmarks/results/gpu-learn.json."
    )
    args = parser.parse_args(argv)
    try:
        args.cs = tuple(sorted(float(c) for c in args.cs.split(",")))
    except ValueError:
        parser.error(f"--cs: {args.cs!r} is not a comma-separated list of numbers")
    if not args.cs or min(args.cs) <= 0:
        parser.error("--cs: every C must be positive")
    if args.points < 1 or args.batch < 1 or args.seq_len < 1 or args.max_steps < 0:
        parser.error("--points, --batch and --seq-len must be at least 1, --max-steps at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"gpu-learn: {error}", file=sys.stderr)
        return 2
    if args.json_path:
        args.json_path.write_text(json.dumps(report, indent=2) + "\n")
    record("gpu-learn", args.record, report, argv=argv, script="gpu_learn")
    print(
        f"\ngpu-learn: {report['steps']} steps of {args.preset}, {report['seconds']:.0f} s (budget {args.budget:.0f} s)"
    )
    print(
        "| training min | step | chars seen | train loss | val bits/byte | SST test (unit) | IMDB test (unit) |"
    )
    print("|---|---|---|---|---|---|---|")
    for p in report["points"]:
        loss = "—" if p["train_loss"] is None else f"{p['train_loss'] / math.log(2):.3f}"
        cells = [f"{p[n]['test_accuracy']:.1%} ({p[n]['top_unit_accuracy']:.1%})" for n in ("sst", "imdb")]
        print(
            f"| {p['train_s'] / 60:.2f} | {p['step']} | {p['chars_seen']:,} | {loss} | "
            f"{p['val_bits_per_byte']:.3f} | {' | '.join(cells)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
