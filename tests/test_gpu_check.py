"""`make gpu-check` (benchmarks/gpu_check.py) where no GPU is: one line and a failure, or every part at
toy sizes on the CPU (its rehearsal); and benchmarks/job.py's real job, preempted and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_the_check_says_so_in_one_line_and_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("gpu_check.py", "gpu_check", monkeypatch)
    assert module.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "sees no CUDA device" in err


@pytest.mark.long  # about 80 s on two cores: five parts, the job's six launches most of it
def test_the_rehearsal_runs_every_part_and_tables_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("gpu_check.py", "gpu_check", monkeypatch)
    code = module.main(["--rehearse", "--logs", str(tmp_path)])
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert list(parts) == ["pretrain", "features", "probe", "tests", "job"]
    assert code == 0, parts
    assert parts["tests"]["figures"]["skipped"] > 0  # the -m gpu tests were collected, and skip on a CPU
    assert all(row["equal"] for row in parts["job"]["figures"]["rows"])


@pytest.mark.long  # about 50 s on two cores: six launches of the job
def test_a_job_preempted_and_resumed_equals_one_left_alone_unsharded_and_fsdp_on_one_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("job.py", "job_benchmark", monkeypatch)
    out = tmp_path / "job.json"
    assert module.main(["--json", str(out)]) == 0
    rows = {row["sharding"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "full"}
    for row in rows.values():
        assert row["signalled_at"] <= row["checkpointed_at"] < row["steps"]
        assert row["equal"] and row["max_weight_rel_diff"] <= 1e-5
    assert rows["full"]["sharded_checkpoint"] and not rows["none"]["sharded_checkpoint"]
