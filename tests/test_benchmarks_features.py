"""The feature benchmark runs end to end on the tiny preset, serving included, and prints the JSON it promises.

Timings never decide pass or fail: only that every number is there, positive and consistent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "features.py"


@pytest.mark.slow
def test_the_features_benchmark_prints_its_json_report() -> None:
    argv = ["--presets", "tiny", "--texts", "32", "--baseline-texts", "8", "--batch-size", "16"]
    argv += ["--precisions", "fp32,bf16"]
    argv += ["--requests", "3", "--warmup-requests", "1", "--serve-preset", "tiny", "--serve-batch", "64"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv, "--device", "cpu", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)  # JSON alone on stdout: the tables and MLflow's logs went to stderr
    assert "Feature extraction" in done.stderr and "Served model" in done.stderr

    assert set(report) >= {"machine", "command", "settings", "texts_source", "weights", "features", "serving"}
    assert report["checks_failed"] == []
    assert report["weights"].startswith("random")
    row, in_bf16 = report["features"]
    assert (row["preset"], row["device"], row["precision"]) == ("tiny", "cpu", "fp32")
    # The second precision's row, compared with the first: its rate's ratio, its features near fp32's.
    assert (in_bf16["preset"], in_bf16["precision"], in_bf16["texts"]) == ("tiny", "bf16", 32)
    assert row["vs_first_precision"] is None
    assert in_bf16["vs_first_precision"] == pytest.approx(in_bf16["chars_per_s"] / row["chars_per_s"])
    assert 0 < in_bf16["first_precision_rel_diff"] < 5e-2 and in_bf16["max_rel_diff"] < 5e-2
    assert "tiny: bf16 reads" in done.stderr
    assert (row["texts"], row["baseline_texts"], row["batch_size"]) == (32, 8, 16)
    assert row["chars"] > 32 * 3 and row["baseline_chars"] > 8 * 3  # every text has its 3 pad bytes
    assert row["chars_per_s"] > 0 and row["baseline_chars_per_s"] > 0 and row["ratio"] > 0
    assert row["ratio"] == pytest.approx(row["chars_per_s"] / row["baseline_chars_per_s"])
    assert row["max_rel_diff"] < 1e-4  # the fast path, the reference and the per-text loop agree
    assert row["batch_sized_by"] == "--batch-size" and 0 <= row["padding"] < 0.1
    assert row["vs_reference"] == pytest.approx(row["chars_per_s"] / row["reference_chars_per_s"])

    # Each precision's requests: its parameter sent with each (tests/test_serving.py: it reaches the model).
    assert [(s["preset"], s["precision"], s["batch"]) for s in report["serving"]] == [
        ("tiny", "fp32", 1),
        ("tiny", "fp32", 64),
        ("tiny", "bf16", 1),
        ("tiny", "bf16", 64),
    ]
    for serve in report["serving"]:
        assert serve["requests"] == 3 and len(serve["latencies_ms"]) == 3
        assert 0 < serve["p50_ms"] <= serve["p99_ms"]
        assert serve["per_text_ms"] == pytest.approx(serve["p50_ms"] / serve["batch"])
