"""The pipeline benchmark runs its three commands and reports them; its own stage checks must hold.

Timings never decide pass or fail: only that each run is there, with the stage states it promises.
"""

from __future__ import annotations

import json
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
