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
