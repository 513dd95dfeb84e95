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


def test_the_continue_benchmark_trains_a_base_a_scratch_run_and_continued_runs_choosing_on_val_alone(
    amazon_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "continue.py"), "--steps", "20", "--batch", "20", "--seq-len", "32",
         "--replay", "0.05", "0.5", "--continued-lr", "0.001"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "MLSTM_SHARED_DIR": str(amazon_dir.parents[1])},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    rows = {row["case"]: row for row in report["rows"]}
    grid = ["(b) continued, replay 0.05, lr 0.001", "(b) continued, replay 0.5, lr 0.001"]
    assert list(rows) == ["base", "(a) scratch", *grid, "(c) continued, no replay"]
    # (b) and (c) take --share of (a)'s steps; every run is scored on the grown, delta and base val splits.
    assert [row["steps"] for row in rows.values()] == [20, 20, 3, 3, 3]
    assert all(set(row["val_bpb"]) == {"full", "delta", "base"} for row in rows.values())
    assert all(0 < bits < 8 for row in rows.values() for bits in row["val_bpb"].values())
    # The chosen (b) is the grid's best on the full val split; (c) runs at its rate.
    chosen = rows[report["chosen"]]
    assert chosen["val_bpb"]["full"] == min(rows[name]["val_bpb"]["full"] for name in grid)
    assert rows["(c) continued, no replay"]["lr"] == chosen["lr"]
    # Test splits are read once, at the end, for the runs the goal compares and no other.
    tested = [name for name, row in rows.items() if "test_bpb" in row]
    assert tested == ["base", "(a) scratch", report["chosen"], "(c) continued, no replay"]
    # The goal's ratios are the rows' own: the chosen (b) against (a).
    scratch = rows["(a) scratch"]
    assert report["goal"]["steps_ratio"] == chosen["steps"] / scratch["steps"]
    assert report["goal"]["bpb_ratio"] == chosen["val_bpb"]["full"] / scratch["val_bpb"]["full"]
    assert report["goal"]["test_bpb_ratio"] == chosen["test_bpb"]["full"] / scratch["test_bpb"]["full"]
    # Passes over the text each run reads fresh: a replayed row (5% of 20: one; 50%: ten) reads the base.
    train = report["train_bytes"]
    assert rows[grid[0]]["fresh_passes"] == pytest.approx(3 * 19 * 32 / train["delta"])
    assert rows[grid[1]]["fresh_passes"] == pytest.approx(3 * 10 * 32 / train["delta"])
    assert rows["(c) continued, no replay"]["fresh_passes"] == pytest.approx(3 * 20 * 32 / train["delta"])
    assert scratch["fresh_passes"] == pytest.approx(20 * 20 * 32 / train["full"])


def test_the_continue_benchmark_refuses_a_replay_share_of_no_row_before_it_trains(amazon_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "continue.py"), "--batch", "8", "--replay", "0.5", "0.05"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "MLSTM_SHARED_DIR": str(amazon_dir.parents[1])},
    )  # fmt: skip
    assert done.returncode == 2
    assert "--replay 0.05 of a batch of 8 rows rounds to no row" in done.stderr
    assert "training" not in done.stderr and "building" not in done.stderr  # refused before any work
