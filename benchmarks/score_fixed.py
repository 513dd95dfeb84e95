#!/usr/bin/env python
"""The fixed cost of scoring a small table: what ``score`` of a few hundred rows pays besides the work.

Issue 52 found ``score`` of 200 rows taking 27 s where ``predict --input`` took 8 s, most of it the
temporary Prefect API and the process pool's worker starting (importing torch, Prefect and MLflow) for
a run of one piece. ``--rows`` reviews of the shared IMDB test set (every k-th, as benchmarks/score.py
takes them), a tiny classifier (random weights: the time does not depend on them) registered as
champion in a temporary home, and in one run, each row ``--repeat`` times (the fastest kept):

- ``score`` and ``predict --input`` as a user runs them: the command line in a new process (its imports,
  the temporary Prefect API, the flow, MLflow's model load), to a new output each time;
- the score flow in this process on a process pool (what a run of one piece took before) and on a
  thread of this process (``flows.runtime.runner_for``: what it takes now), the temporary API started
  inside the timing as the command starts it; one untimed run first, so that neither row pays this
  process's imports;
- the temporary Prefect API alone, started and stopped.

    PYTHONPATH=. .venv/bin/python benchmarks/score_fixed.py            # about 2 minutes on 2 cores
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (  # the working tree on the path
    add_record_option,
    fastest_of,
    machine,
    new_parser,
    record,
    say,
)
from score import imdb_slice, register, write_csv

CLI = Path(sys.executable).parent / "mlstm-sentiment"


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--rows", type=int, default=200, help="IMDB test reviews in the table. [200]")
    parser.add_argument("--repeat", type=int, default=3, help="Runs of each row; the fastest is kept. [3]")
    add_record_option(parser)
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeat < 1:
        parser.error(f"--rows {args.rows}, --repeat {args.repeat}: each must be at least 1")
    with tempfile.TemporaryDirectory(prefix="mlstm-bench-score-fixed-") as scratch:
        results = measure(args, Path(scratch))
    record("score_fixed", args.record, results, argv=argv)
    return 0


def measure(args: Any, root: Path) -> dict[str, Any]:
    os.environ["MLSTM_HOME"] = str(root / "home")
    from flows.runtime import prefect_api
    from flows.runtime import task_runner as make_task_runner
    from flows.score import score
    from tasks.settings import get_settings

    load_before = os.getloadavg()[0]
    data = write_csv(root / "reviews.csv", imdb_slice(args.rows))
    say(f"{args.rows} IMDB test reviews; registering a tiny classifier")
    register("tiny")
    outputs = itertools.count()  # a new output folder for each run: nothing skipped

    def command(*words: str) -> Callable[[], None]:
        def run() -> None:
            output = ["--output", str(root / f"out-{next(outputs)}")] if words[0] == "score" else []
            done = subprocess.run([str(CLI), *words, *output], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{' '.join(words)}: exit {done.returncode}\n{done.stderr[-2000:]}")

        return run

    def flow_on(runner: str) -> Callable[[], None]:
        def run() -> None:
            settings = get_settings(task_runner=runner)  # type: ignore[arg-type]
            flow = score.with_options(task_runner=make_task_runner(settings))
            with prefect_api(settings):
                flow(inputs=[str(data)], output=str(root / f"out-{next(outputs)}"))

        return run

    def api_alone() -> None:
        with prefect_api(get_settings()):
            pass

    flow_on("thread")()  # this process's imports, outside every timing
    rows = [
        fastest_of("`score` command", command("score", str(data)), args.repeat),
        fastest_of("`predict --input` command", command("predict", "--input", str(data)), args.repeat),
        fastest_of("score flow, process pool (before, one piece)", flow_on("process"), args.repeat),
        fastest_of("score flow, thread (now, one piece)", flow_on("thread"), args.repeat),
        fastest_of("temporary Prefect API alone", api_alone, args.repeat),
    ]
    by_name = {row["name"]: row["seconds"] for row in rows}
    results = {
        "settings": {"rows": args.rows, "repeat": args.repeat, "preset": "tiny"},
        "rows": rows,
        "ratios": {
            "score_vs_predict": by_name["`score` command"] / by_name["`predict --input` command"],
            "thread_vs_process_pool": by_name["score flow, thread (now, one piece)"]
            / by_name["score flow, process pool (before, one piece)"],
        },
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "machine": machine(),
    }
    for row in rows:
        say(f"{row['name']:<48} {row['seconds']:7.2f} s  ({', '.join(f'{r:g}' for r in row['runs'])})")
    for name, value in results["ratios"].items():
        say(f"{name:<48} {value:7.2f}")
    return results


if __name__ == "__main__":
    raise SystemExit(main())
