#!/usr/bin/env python
"""How fast the CLI answers when it has nothing to do but answer: help, a refusal, an empty status.

Each case runs ``mlstm-sentiment ARGS`` from this checkout as a new process (what a user waits for), in
a fresh MLSTM_HOME, ``--repeat`` times; the table gives the median wall time, the ratio to the named
baseline (the interpreter starting and importing the CLI's own framework, ``python -c "import typer"``:
what no command can avoid), and which heavy libraries the command imported (``python -X importtime``),
since importing torch alone takes seconds on a small machine.

    PYTHONPATH=. .venv/bin/python benchmarks/cli.py --record
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_record_option, checkout_path, describe, machine, new_parser, record, say

HEAVY = ("torch", "mlflow", "prefect", "sklearn", "pyarrow", "scipy", "boto3")
ENTRY = "from flows.cli import main; main()"
# (name, arguments, expected exit code): the answers that need no work behind them.
CASES: list[tuple[str, list[str], int]] = [
    ("--help", ["--help"], 0),
    ("pretrain --help", ["pretrain", "--help"], 0),
    ("a bad flag: pretrain --bogus", ["pretrain", "--corpus", "c", "--bogus"], 2),
    ("a bad flag: run --bogus", ["run", "pretrain", "--bogus"], 2),
    ("a bad stage: run nosuch", ["run", "nosuch"], 2),
    (
        "a missing file: pretrain --corpus /nonexistent",
        ["pretrain", "--corpus", "/nonexistent/manifest.json"],
        2,
    ),
    ("a bad setting: pretrain --batch-size 0", ["pretrain", "--corpus", "c", "--batch-size", "0"], 2),
    ("status, nothing ever ran", ["status"], 0),
]


def timed(command: list[str], env: dict[str, str], repeat: int, expect: int | None) -> list[float]:
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        seconds.append(time.perf_counter() - start)
        if expect is not None and done.returncode != expect:
            raise SystemExit(
                f"{command[3:]} exited {done.returncode}, expected {expect}:\n{done.stdout}{done.stderr}"
            )
    return seconds


def imported(arguments: list[str], env: dict[str, str]) -> list[str]:
    """The heavy top-level packages a command imports, from ``-X importtime``'s report on stderr."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", ENTRY, *arguments], env=env, capture_output=True, text=True
    )
    modules = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if "|" in line}
    return [name for name in HEAVY if name in modules]


def main(argv: list[str] | None = None) -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--repeat", type=int, default=5, help="Runs per case; the median is reported.")
    parser.add_argument("--json", action="store_true", help="Print the results as JSON on stdout.")
    add_record_option(parser)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlstm-cli-") as home:
        env = {**os.environ, "PYTHONPATH": checkout_path(), "MLSTM_HOME": home}
        for name in ("MLSTM_STORE_URI", "MLSTM_MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
            env.pop(name, None)  # the embedded defaults, as on a fresh machine
        baseline = statistics.median(timed([sys.executable, "-c", "import typer"], env, args.repeat, 0))
        say(f"baseline (python -c 'import typer'): {baseline:.3f} s")

        def measure(name: str, arguments: list[str], expect: int) -> None:
            seconds = statistics.median(
                timed([sys.executable, "-c", ENTRY, *arguments], env, args.repeat, expect)
            )
            heavy = imported(arguments, env)
            say(f"{name}: {seconds:.3f} s, imports {', '.join(heavy) or 'none of ' + '/'.join(HEAVY)}")
            rows.append({"case": name, "args": arguments, "seconds": seconds, "vs_baseline": seconds / baseline,
                         "imports": heavy})  # fmt: skip

        for name, arguments, expect in CASES:
            measure(name, arguments, expect)
        if any(Path(home).iterdir()):
            say(f"note: the commands left {sorted(p.name for p in Path(home).iterdir())} in a fresh home")
        # Once MLflow's database exists, status loads MLflow to read it: measured beside the rest.
        subprocess.run(
            [sys.executable, "-c", "from tasks.settings import get_settings; from tasks.tracking import connect; "
             "connect(get_settings())"], env=env, check=True, capture_output=True,
        )  # fmt: skip
        measure("status, an MLflow database without runs", ["status"], 0)
    info = machine()
    results = {"machine": info, "baseline_seconds": baseline, "repeat": args.repeat, "cases": rows}
    print(f"\nCLI answers, median of {args.repeat} ({describe(info)})")
    print(f"{'case':<48} {'seconds':>8} {'× baseline':>10}  heavy imports")
    print(f"{'python -c import typer (baseline)':<48} {baseline:>8.3f} {1:>10.1f}")
    for row in rows:
        print(
            f"{row['case']:<48} {row['seconds']:>8.3f} {row['vs_baseline']:>10.1f}  {', '.join(row['imports']) or '-'}"
        )
    if args.json:
        print(json.dumps(results))
    record("cli", args.record, results)


if __name__ == "__main__":
    main()
