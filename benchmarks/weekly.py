#!/usr/bin/env python
"""What a weekly run (`pipeline --incremental`) costs against a full one, stage by stage, on real reviews.

Runs `mlstm-sentiment pipeline` as a user does (a subprocess, the embedded defaults: a temporary Prefect
API, MLflow on SQLite, the store in a folder) on Amazon review files of the shared data beside the checkout (or
``--data``): a few small files are last week's sources, one more is the week's new file.

- set-up (not measured): in the weekly home, `pipeline BASE --incremental` with no champion: a full run
  that trains a tiny mLSTM from its seed for ``--steps`` steps and registers the first champion;
- (a) full: in a new home, `pipeline BASE+NEW`: the corpus of every source, ``--steps`` steps from scratch;
- (b) weekly: in the weekly home, `pipeline BASE+NEW --incremental`: the corpus grows by the new file's
  delta, pretraining continues from the champion's checkpoint for ``--share`` of (a)'s steps (warm-up a
  tenth of them, the pipeline's ``continued_warmup``; replay ``--replay`` of the champion's corpus), the
  probes read the new weights.

Each stage's seconds are the pipeline's own record of it (its key, skip check and subflow); the whole run
is the command's wall time, start-up included. Ratio = (b) ÷ (a), of one run. Both train on the same
rows (a grown corpus equals a full build), so their validation bits per byte are comparable. The stage
states and the weekly run's delta and parent are checked, so a run that did something else fails it.

    .venv/bin/python benchmarks/weekly.py                   # table on stderr
    .venv/bin/python benchmarks/weekly.py --steps 20 --json  # the smallest run (tests/test_benchmarks_pipeline.py)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import add_record_option, checkout_path, describe, machine, new_parser, record, say, timed_cli

# The shared data beside the checkout (MLSTM_SHARED_DIR overrides, as in the tests).
DATA = (
    Path(os.environ.get("MLSTM_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
    / "data"
    / "amazon"
)
# Last week's sources and the week's new file: 2018 5-core files, small enough for 2 cores. Appliances
# repeats most of its records (2,074 of 2,277), so the delta is a few percent of the corpus's rows.
BASE = ("AMAZON_FASHION_5.json.gz", "Gift_Cards_5.json.gz", "Magazine_Subscriptions_5.json.gz")
NEW = "Appliances_5.json.gz"
STAGES = ("corpus", "pretrain", "transfer")


def environment(home: Path) -> dict[str, str]:
    """A user's environment with a home of its own: its store, MLflow database and registry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLSTM_", "PREFECT_API_URL"))}
    return env | {
        "MLSTM_HOME": str(home / "home"),
        "PREFECT_HOME": str(home / "prefect"),
        "PYTHONPATH": checkout_path(),
    }


def checked(name: str, result: dict[str, Any], states: dict[str, str]) -> None:
    found = {stage: info["state"] for stage, info in result["stages"].items()}
    if found != states:
        raise SystemExit(f"{name}: stages {found}, expected {states}")


def run_row(name: str, seconds: float, result: dict[str, Any]) -> dict[str, Any]:
    pretrain = result["pretrain"]
    return {
        "run": name,
        "seconds": round(seconds, 1),
        "stage_seconds": {stage: round(info["seconds"], 1) for stage, info in result["stages"].items()},
        "rows": result["corpus"]["rows"],
        "steps": pretrain["steps"],
        "val_bpc": pretrain["val_bpc"],
    }


def main() -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--data", type=Path, default=DATA, help="the Amazon files' folder")
    parser.add_argument("--steps", type=int, default=200, help="steps of the set-up run and of (a)")
    parser.add_argument("--share", type=float, default=0.15, help="(b)'s steps, a share of --steps")
    parser.add_argument("--replay", type=float, default=0.05, help="(b)'s replay share")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    add_record_option(parser)
    args = parser.parse_args()
    missing = [name for name in (*BASE, NEW) if not (args.data / name).is_file()]
    if missing:
        raise SystemExit(f"--data {args.data}: no {', '.join(missing)} (the shared Amazon files)")
    continued = max(1, round(args.share * args.steps))

    from tasks.corpus.sample import write_labelled_sample

    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="mlstm-bench-weekly-") as scratch:
        root = Path(scratch)
        labelled = write_labelled_sample(root / "labelled", num_reviews=300)
        base = [str(args.data / name) for name in BASE]
        every = [*base, str(args.data / NEW)]
        common = ["--dataset", f"reviews={labelled}"]
        for setting in (
            "corpus.split=[90,5,5]",
            "pretrain.batch_size=16",
            "pretrain.seq_len=64",
            "pretrain.lr=0.003",
            "pretrain.retries=0",
            "transfer.baseline=false",
        ):
            common += ["--set", setting]

        def budget(steps: int) -> list[str]:
            settings = [f"total_steps={steps}", f"val_every={steps}", f"checkpoint_every={steps}"]
            return ["--max-steps", str(steps), *(a for s in settings for a in ("--set", f"pretrain.{s}"))]

        ran = dict.fromkeys(STAGES, "ran")
        weekly_env = environment(root / "weekly")
        say(f"set-up: the champion trained on {len(base)} files, {args.steps} steps")
        setup_seconds, setup = timed_cli(
            ["pipeline", *base, "--incremental", *common, *budget(args.steps)], weekly_env, root
        )
        checked("set-up", setup, ran)
        if setup["transfer"]["registered"] is None or not setup["transfer"]["registered"]["promoted"]:
            raise SystemExit("set-up: its model was not registered as the champion")
        say(f"(a) full: every source, {args.steps} steps from scratch")
        full_seconds, full = timed_cli(
            ["pipeline", *every, *common, *budget(args.steps)], environment(root / "full"), root
        )
        checked("(a) full", full, ran)
        say(f"(b) weekly: the delta of {NEW}, {continued} steps continued")
        weekly_seconds, weekly = timed_cli(
            [
                "pipeline",
                *every,
                "--incremental",
                *common,
                *budget(continued),  # the pipeline warms it up over a tenth (continued_warmup)
                "--set",
                f"replay={args.replay}",
            ],
            weekly_env,
            root,
        )
        checked("(b) weekly", weekly, ran)
        grown = weekly["incremental"]
        if not (grown["continued"] and grown["delta_rows"] > 0 and not grown["full"]):
            raise SystemExit(f"(b) weekly: not a delta continued from the champion: {grown}")
        if weekly["corpus"]["rows"] != full["corpus"]["rows"]:
            raise SystemExit(
                f"rows: the grown corpus {weekly['corpus']['rows']}, the full {full['corpus']['rows']}"
            )
    load.append(os.getloadavg()[0])

    runs = [run_row("(a) full", full_seconds, full), run_row("(b) weekly", weekly_seconds, weekly)]
    a, b = runs
    stages = [
        {
            "stage": stage,
            "full_s": a["stage_seconds"][stage],
            "weekly_s": b["stage_seconds"][stage],
            "ratio": round(b["stage_seconds"][stage] / a["stage_seconds"][stage], 3),
        }
        for stage in STAGES
    ]
    stages.append(
        {
            "stage": "whole run",
            "full_s": a["seconds"],
            "weekly_s": b["seconds"],
            "ratio": round(b["seconds"] / a["seconds"], 3),
        }
    )
    info = machine()
    results = {
        "machine": info,
        "settings": {
            "base": list(BASE),
            "new": NEW,
            "steps": args.steps,
            "continued_steps": continued,
            "replay": args.replay,
        },
        "setup_seconds": round(setup_seconds, 1),
        "delta_rows": grown["delta_rows"],
        "runs": runs,
        "stages": stages,
        "notes": f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
        f"{info['cores']} cores",
    }
    print(
        f"weekly run vs full: {len(BASE)} Amazon files + {NEW} (delta {grown['delta_rows']:,} rows of "
        f"{b['rows']:,}), tiny mLSTM {args.steps} vs {continued} steps · {describe(info)}",
        file=sys.stderr,
    )
    print(f"{'stage':<10} {'(a) full s':>11} {'(b) weekly s':>13} {'b ÷ a':>7}", file=sys.stderr)
    for row in stages:
        print(
            f"{row['stage']:<10} {row['full_s']:>11.1f} {row['weekly_s']:>13.1f} {row['ratio']:>7.2f}",
            file=sys.stderr,
        )
    for run in runs:
        print(f"{run['run']}: {run['steps']} steps, val bpc {run['val_bpc']}", file=sys.stderr)
    say(results["notes"])
    if args.json:
        print(json.dumps(results))
    record("weekly", args.record, results)


if __name__ == "__main__":
    main()
