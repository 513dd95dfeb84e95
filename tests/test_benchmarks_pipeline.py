"""The pipeline benchmark runs its three commands and reports them; its own stage checks must hold.

Timings never decide pass or fail: only that each run is there, with the stage states it promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.long
def test_the_pipeline_benchmark_reports_first_unchanged_and_rerun() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pipeline.py"), "--reviews", "600", "--steps", "20", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert [run["run"] for run in report["runs"]] == ["first", "unchanged", "rerun transfer"]
    assert set(report["runs"][1]["stages"].values()) == {"skipped"}
    assert report["runs"][2]["stages"] == {"transfer": "ran"}
    assert all(run["seconds"] > 0 and run["ratio"] > 0 for run in report["runs"])
    assert "first ÷ run" in done.stderr


@pytest.mark.long  # three pipeline runs on real reviews: about 4 minutes on 2 busy cores
def test_the_weekly_benchmark_reports_each_stage_of_a_full_and_a_weekly_run(amazon_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "weekly.py"), "--steps", "10", "--data", str(amazon_dir), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert [row["stage"] for row in report["stages"]] == ["corpus", "pretrain", "transfer", "whole run"]
    assert all(row["full_s"] > 0 and row["weekly_s"] > 0 and row["ratio"] > 0 for row in report["stages"])
    full, weekly = report["runs"]
    assert full["rows"] == weekly["rows"] and report["delta_rows"] > 0
    assert (full["steps"], weekly["steps"]) == (10, 2)
    # The stages' own seconds fit in each command's wall time.
    assert all(sum(run["stage_seconds"].values()) <= run["seconds"] for run in report["runs"])
    assert "(b) ÷ (a)" not in done.stderr and "b ÷ a" in done.stderr


def test_the_continue_benchmark_trains_four_runs_and_scores_each_on_three_val_splits(
    amazon_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "continue.py"), "--steps", "20", "--batch", "20", "--seq-len", "32"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "MLSTM_SHARED_DIR": str(amazon_dir.parents[1])},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    rows = {row["case"]: row for row in report["rows"]}
    assert list(rows) == ["base", "(a) scratch", "(b) continued, replay", "(c) continued, no replay"]
    # (b) and (c) take --share of (a)'s steps; every run is scored on the grown, delta and base val splits.
    assert [row["steps"] for row in rows.values()] == [20, 20, 3, 3]
    assert all(set(row["val_bpb"]) == {"full", "delta", "base"} for row in rows.values())
    assert all(0 < bits < 8 for row in rows.values() for bits in row["val_bpb"].values())
    # The goal's ratios are the rows' own: (b) against (a).
    scratch, replay = rows["(a) scratch"], rows["(b) continued, replay"]
    assert report["goal"]["steps_ratio"] == replay["steps"] / scratch["steps"]
    assert report["goal"]["bpb_ratio"] == replay["val_bpb"]["full"] / scratch["val_bpb"]["full"]
    # Passes over the text each run reads fresh: (b)'s replayed row (5% of 20) reads the base, not the delta.
    train = report["train_bytes"]
    assert replay["fresh_passes"] == pytest.approx(3 * 19 * 32 / train["delta"])
    assert rows["(c) continued, no replay"]["fresh_passes"] == pytest.approx(3 * 20 * 32 / train["delta"])
    assert scratch["fresh_passes"] == pytest.approx(20 * 20 * 32 / train["full"])
