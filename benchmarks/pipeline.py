#!/usr/bin/env python
"""What a pipeline run costs when its inputs have not changed, against the first run that did the work.

Runs `mlstm-sentiment pipeline` as a user does (a subprocess, the embedded defaults: a temporary Prefect
API, MLflow on SQLite, the store in a temporary folder) on a generated sample in the Amazon formats:

- first: every stage runs (corpus, a tiny mLSTM for --steps steps, the probe, the registration);
- unchanged: the same command again; every stage is found by its content key and skipped;
- rerun transfer: `mlstm-sentiment run transfer`, forced, with the features already in the store's cache.

Wall-clock seconds of each command, start-up included; ratio = first ÷ that run (the named baseline is the
first run). The stage states are checked, so a skip that silently ran again fails the benchmark.

    .venv/bin/python benchmarks/pipeline.py                  # table on stderr
    .venv/bin/python benchmarks/pipeline.py --steps 40 --json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from common import add_record_option, describe, machine, new_parser, record, timed_cli


def main() -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--reviews", type=int, default=3000, help="reviews in the generated sample")
    parser.add_argument("--steps", type=int, default=300, help="pretraining steps of the tiny mLSTM")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    add_record_option(parser)
    args = parser.parse_args()

    from tasks.corpus.sample import write_labelled_sample, write_sample

    with tempfile.TemporaryDirectory(prefix="mlstm-bench-pipeline-") as scratch:
        root = Path(scratch)
        sample = write_sample(root / "sample", num_reviews=args.reviews)[0].parent
        labelled = write_labelled_sample(root / "labelled")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLSTM_", "PREFECT_API_URL"))}
        env |= {"MLSTM_HOME": str(root / "home"), "PREFECT_HOME": str(root / "prefect")}
        pipeline = [
            "pipeline",
            str(sample),
            "--dataset",
            f"reviews={labelled}",
            "--max-steps",
            str(args.steps),
        ]
        for setting in (
            "corpus.split=[90,5,5]",
            "pretrain.batch_size=16",
            "pretrain.seq_len=64",
            "pretrain.lr=0.003",
        ):
            pipeline += ["--set", setting]
        runs = []
        for name, command, expected in (
            ("first", pipeline, {"corpus": "ran", "pretrain": "ran", "transfer": "ran"}),
            ("unchanged", pipeline, {"corpus": "skipped", "pretrain": "skipped", "transfer": "skipped"}),
            ("rerun transfer", ["run", "transfer"], {"transfer": "ran"}),
        ):
            seconds, result = timed_cli(command, env, root)
            states = {stage: info["state"] for stage, info in result["stages"].items()}
            if states != expected:
                raise SystemExit(f"{name}: stages {states}, expected {expected}")
            runs.append({"run": name, "seconds": round(seconds, 1), "stages": states})
    first = runs[0]["seconds"]
    for run in runs:
        run["ratio"] = round(first / run["seconds"], 1)
    info = machine()
    print(
        f"pipeline on a {args.reviews:,}-review sample, tiny mLSTM {args.steps} steps · {describe(info)}",
        file=sys.stderr,
    )
    print(f"{'run':<16} {'seconds':>8} {'first ÷ run':>12}  stages", file=sys.stderr)
    for run in runs:
        stages = ", ".join(f"{k} {v}" for k, v in run["stages"].items())
        print(f"{run['run']:<16} {run['seconds']:>8.1f} {run['ratio']:>11.1f}×  {stages}", file=sys.stderr)
    if args.json:
        print(json.dumps({"machine": info, "runs": runs}))
    settings = {"reviews": args.reviews, "steps": args.steps}
    record("pipeline", args.record, {"machine": info, "settings": settings, "runs": runs})


if __name__ == "__main__":
    main()
