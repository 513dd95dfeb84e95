#!/usr/bin/env python
"""The L1 probe's full C sweep: the newton and torch solvers against liblinear (the reference), same run.

Each case fits ``tasks.transfer.probe.fit_probe`` on the same train/dev/test arrays once with
``solver="liblinear"`` (the baseline) and once with each solver of ``--solvers`` (newton, torch: on CUDA
when torch sees one, else CPU threads), over the C values 2^c_min … 2^c_max, and reports, one row per
solver, each sweep's seconds, the speed-up (liblinear ÷ solver), the chosen C and both accuracies.

The features are synthetic, built like cell states: a ``width``-wide tanh of 64 shared latent factors
plus noise, each column scaled by a factor in [0.2, 3], labels drawn from a logistic model on 8 columns
(a known sparse answer). Row counts follow the real splits: SST-sized 6,920 / 872 / 1,821, IMDB-sized
22,500 / 2,500 / 25,000. No trained 4096-unit model fits this machine, so these are not real features;
real cell states are worse conditioned, and both solvers slow down on them.

    PYTHONPATH=. .venv/bin/python benchmarks/probe.py                           # SST 1024 and 4096, IMDB 1024
    PYTHONPATH=. .venv/bin/python benchmarks/probe.py --cases sst:256 --c-max-log2 -4 --json
    PYTHONPATH=. .venv/bin/python benchmarks/probe.py --cases sst:1024 --solvers newton --record cpu
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from common import add_record_option, describe, machine, new_parser, record, say

from tasks.transfer.probe import SOLVERS, ProbeResult, Solver, fit_probe

ROWS = {"sst": (6920, 872, 1821), "imdb": (22500, 2500, 25000)}
Splits = list[tuple[np.ndarray, np.ndarray]]


def cell_state_like(rows: tuple[int, ...], width: int, seed: int = 0) -> Splits:
    """Train, dev and test splits of synthetic features (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    mixing = (rng.standard_normal((64, width)) / 4).astype(np.float32)
    scale_H = rng.uniform(0.2, 3.0, width).astype(np.float32)
    w_true = rng.choice([-2.0, 2.0], 8)
    splits = []
    for n in rows:
        X = rng.standard_normal((n, 64)).astype(np.float32) @ mixing
        X = np.tanh(X + 0.5 * rng.standard_normal((n, width)).astype(np.float32)) * scale_H
        y = (rng.random(n) < 1 / (1 + np.exp(-(X[:, :8] @ w_true)))).astype(np.int64)
        splits.append((X, y))
    return splits


def timed(
    splits: Splits, solver: Solver, Cs: tuple[float, ...], device: str
) -> tuple[float, list[float], ProbeResult]:
    """The sweep's wall seconds, each C's (fit and dev scoring, from the previous C's end), the result."""
    per_C: list[float] = []
    last = time.perf_counter()

    def progress(point: object) -> None:
        nonlocal last
        if device == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        per_C.append(now - last)
        last = now
        say(f"  {solver}: {point} ({per_C[-1]:.2f} s)")

    started = last
    result = fit_probe(
        *splits[0], *splits[1], *splits[2], Cs=Cs, solver=solver, device=device, on_fit=progress
    )
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, per_C, result


def main() -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--cases", default="sst:1024,sst:4096,imdb:1024", help="ROWS:WIDTH, comma-separated")
    parser.add_argument("--c-min-log2", type=int, default=-8)
    parser.add_argument("--c-max-log2", type=int, default=2)
    parser.add_argument(
        "--solvers", default="newton,torch", help="solvers compared with liblinear, comma-separated"
    )
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    add_record_option(parser)
    args = parser.parse_args()
    solvers = args.solvers.split(",")
    if unknown := [s for s in solvers if s not in SOLVERS or s == "liblinear"]:
        parser.error(f"--solvers: {', '.join(unknown)} is not one of newton, torch")
    Cs = tuple(2.0**k for k in range(args.c_min_log2, args.c_max_log2 + 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = machine(torch.device(device))
    rows = []
    for case in args.cases.split(","):
        name, _, width = case.partition(":")
        splits = cell_state_like(ROWS[name], int(width))
        say(f"{name} × {width}: {len(Cs)} values of C")
        base_s, base_per_C, base = timed(splits, "liblinear", Cs, "cpu")
        for solver in solvers:
            fast_s, fast_per_C, fast = timed(splits, solver, Cs, device)
            rows.append(
                {
                    "case": f"{name}-sized × {width}",
                    "solver": solver,
                    "liblinear_s": round(base_s, 2),
                    "solver_s": round(fast_s, 2),
                    "speedup": round(base_s / fast_s, 2),
                    "C": [base.C, fast.C],
                    "dev_accuracy": [round(base.dev_accuracy, 4), round(fast.dev_accuracy, 4)],
                    "test_accuracy": [round(base.test_accuracy, 4), round(fast.test_accuracy, 4)],
                    "max_dev_gap_points": round(
                        100
                        * max(
                            abs(a.dev_accuracy - b.dev_accuracy)
                            for a, b in zip(base.sweep, fast.sweep, strict=True)
                        ),
                        2,
                    ),
                    # Where the time goes along the path, and where the two answers part.
                    "per_C": [
                        {
                            "C": a.C,
                            "seconds": [round(a_s, 3), round(b_s, 3)],
                            "dev_accuracy": [round(a.dev_accuracy, 4), round(b.dev_accuracy, 4)],
                            "nonzero": [a.nonzero, b.nonzero],
                        }
                        for a, b, a_s, b_s in zip(base.sweep, fast.sweep, base_per_C, fast_per_C, strict=True)
                    ],
                }
            )
    lines = [
        f"L1 probe sweep, {len(Cs)} C values, newton and torch on {device}: {describe(info)}",
        "| case | solver | liblinear s | solver s | speed-up | C (lib, solver) | dev acc (lib, solver) "
        "| test acc (lib, solver) | max dev gap over C (points) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['solver']} | {r['liblinear_s']} | {r['solver_s']} | {r['speedup']}× | {r['C'][0]:g}, {r['C'][1]:g} "
            f"| {r['dev_accuracy'][0]}, {r['dev_accuracy'][1]} | {r['test_accuracy'][0]}, {r['test_accuracy'][1]} "
            f"| {r['max_dev_gap_points']} |"
        )
    say("\n".join(lines)) if args.json else print("\n".join(lines))
    if args.json:
        print(json.dumps({"machine": info, "Cs": list(Cs), "rows": rows}, indent=2))
    record("probe", args.record, {"machine": info, "Cs": list(Cs), "rows": rows})


if __name__ == "__main__":
    main()
