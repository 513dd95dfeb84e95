"""The pretraining benchmark runs end to end on the tiny preset and writes the report it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark


def test_the_pretrain_benchmark_writes_its_json_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # benchmarks/ is no package: load the script by path, with its folder on sys.path as when it is run
    # (for benchmarks/common.py, which puts the checkout there too); undo both after.
    module = load_benchmark("pretrain.py", "pretrain_benchmark", monkeypatch)

    out = tmp_path / "bench.json"
    argv = ["--presets", "tiny", "--batch", "4", "--seq-len", "8", "--steps", "1", "--warmup", "1"]
    code = module.main([*argv, "--device", "cpu", "--matmul-size", "256", "--json", str(out)])

    assert code == 0
    report = json.loads(out.read_text())
    assert set(report) >= {"machine", "command", "settings", "matmul_peak_flops", "reference", "rows", "goal"}
    assert set(report["matmul_peak_flops"]) == {"fp32"}  # on a CPU: the precision used alone
    assert report["reference"]["paper_chars_per_s"] == 65_000
    impls = [(r["preset"], r["impl"]) for r in report["rows"]]
    assert impls == [("tiny", "fused"), ("tiny", "reference"), ("tiny", "baseline"), ("tiny", "nn.LSTM")]
    for row in report["rows"]:
        assert row["status"] == "ok"
        assert len(row["step_seconds"]) == 1
        assert row["chars_per_s"] > 0 and row["mfu"] > 0 and row["peak_memory_bytes"] > 0
    fused, reference, baseline, _ = report["rows"]
    assert fused["vs_baseline"] == pytest.approx(fused["chars_per_s"] / baseline["chars_per_s"])
    assert fused["vs_reference"] == pytest.approx(fused["chars_per_s"] / reference["chars_per_s"])
    assert baseline["parity_max_abs_diff"] < 1e-4 and reference["parity_max_abs_diff"] < 1e-4
    for other in (reference, baseline):  # same weights, same bytes
        assert fused["first_loss"] == pytest.approx(other["first_loss"], rel=1e-5)
    assert [goal["batch"] for goal in report["goal"]] == [256, 512]
    assert not any(goal["applies"] for goal in report["goal"])  # judged on a GPU in bf16 only
    assert report["checks_failed"] == []


@pytest.mark.slow
def test_the_sharding_benchmark_writes_a_row_per_sharding_against_ddp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("pretrain.py", "pretrain_benchmark_sharding", monkeypatch)

    out = tmp_path / "bench.json"
    # A hung launch fails in 240 s with torchrun's stderr, not at pytest's 600 s with nothing.
    argv = ["--sharding", "full", "--presets", "tiny", "--batch", "4", "--seq-len", "8", "--steps", "1"]
    argv += ["--timeout", "240"]
    assert module.main([*argv, "--warmup", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["sharding"] for r in rows] == ["none", "full"]  # DDP first: the baseline
    assert rows[1]["optimizer_bytes"] * 2 == rows[0]["optimizer_bytes"]
    assert all(r["step_s"] > 0 and r["peak_bytes"] > 0 for r in rows)


def test_the_job_reads_the_peak_the_benchmark_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark saves a GPU's measured peak under a precision's name; the job's mfu must find it."""
    import torch

    from tasks.pretrain.metrics import MEASURED_PEAKS, peak_in_file

    monkeypatch.setenv("MLSTM_HOME", str(tmp_path))
    module = load_benchmark("pretrain.py", "pretrain_benchmark", monkeypatch)
    measure = load_benchmark("pretrain_measure.py", "pretrain_measure_benchmark", monkeypatch)
    gpu = "NVIDIA H100 80GB HBM3"
    module.save_peaks(
        {measure.DTYPE_NAMES[torch.bfloat16]: 7.93e14, measure.DTYPE_NAMES[torch.float16]: 7.9e14}, gpu
    )
    assert peak_in_file(tmp_path / MEASURED_PEAKS, gpu, torch.bfloat16) == 7.93e14
    assert peak_in_file(tmp_path / MEASURED_PEAKS, gpu, torch.float16) == 7.9e14
    assert peak_in_file(tmp_path / MEASURED_PEAKS, "another GPU", torch.bfloat16) is None
