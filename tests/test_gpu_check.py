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
    # As on a lent GPU machine: no key in the environment, so each home signs with a key file of its own.
    monkeypatch.delenv("MLSTM_CHECKPOINT_KEY", raising=False)
    module = load_benchmark("job.py", "job_benchmark", monkeypatch)
    out = tmp_path / "job.json"
    assert module.main(["--json", str(out)]) == 0
    rows = {row["sharding"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "full"}
    for row in rows.values():
        assert row["signalled_at"] <= row["checkpointed_at"] < row["steps"]
        assert row["equal"] and row["max_weight_rel_diff"] <= 1e-5
    assert rows["full"]["sharded_checkpoint"] and not rows["none"]["sharded_checkpoint"]


def test_a_part_marked_beside_the_next_runs_at_the_same_time_as_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tests and the job run side by side (each launches the training job); the others one by one."""
    module = load_benchmark("gpu_check.py", "gpu_check", monkeypatch)
    stamp = "import sys, time; open(sys.argv[1], 'a').write(f'{time.time()}\\n'); time.sleep(1.5)"

    def stamped(name: str, beside_next: bool = False) -> object:
        script = f"{stamp}; open(sys.argv[1], 'a').write(f'{{time.time()}}\\n')"
        argv = ["-c", script, str(tmp_path / f"{name}.times")]
        return module.Part(name, 30, argv, module.summarise_exit, beside_next=beside_next)

    chosen = [stamped("first"), stamped("tests", beside_next=True), stamped("job"), stamped("last")]
    monkeypatch.setattr(module, "parts", lambda args, logs: chosen)
    assert module.main(["--rehearse", "--logs", str(tmp_path)]) == 0
    spans = {p.name: [float(t) for t in (tmp_path / f"{p.name}.times").read_text().split()] for p in chosen}
    assert spans["tests"][0] < spans["job"][1] and spans["job"][0] < spans["tests"][1]  # they overlap
    assert (
        spans["first"][1] <= spans["tests"][0] and max(spans["tests"][1], spans["job"][1]) <= spans["last"][0]
    )


def test_a_part_beside_one_left_out_is_finished_and_said_like_any_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--parts tests` alone: the part marked to run beside the job has no partner, and still gets its line.
    module = load_benchmark("gpu_check.py", "gpu_check", monkeypatch)
    alone = module.Part("tests", 30, ["-c", "pass"], module.summarise_exit, beside_next=True)
    monkeypatch.setattr(module, "parts", lambda args, logs: [alone])
    assert module.main(["--rehearse", "--logs", str(tmp_path)]) == 0
    assert "[gpu-check] tests: passed in" in capsys.readouterr().err


def test_the_parts_limits_span_the_budget_and_the_budget_leaves_the_check_inside_its_goal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 54: the whole check in at most 7 minutes on one GPU, so every part run to its limit must
    still end inside the budget (6.5 minutes), a part beside the next counting with it once."""
    module = load_benchmark("gpu_check.py", "gpu_check", monkeypatch)
    chosen = module.parts(module.parse_args([]), Path("logs"))
    assert [p.name for p in chosen] == ["pretrain", "features", "probe", "tests", "job", "scaling", "render"]
    assert module.span_s(chosen) <= module.BUDGET_S <= module.CHECK_GOAL_S - 30
    # The span counts side-by-side parts as the longer one, and a trailing one too.
    part = module.Part
    assert (
        module.span_s([part("a", 10, [], module.summarise_exit, beside_next=True), part("b", 20, [], None)])
        == 20
    )
    assert module.span_s([part("a", 10, [], None), part("b", 5, [], None, beside_next=True)]) == 15


def test_a_part_over_its_limit_is_stopped_reported_as_timed_out_and_the_next_one_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load_benchmark("gpu_check.py", "gpu_check", monkeypatch)
    slow = module.Part("slow", 1, ["-c", "import time; time.sleep(60)"], module.summarise_exit)
    after = module.Part("after", 30, ["-c", "pass"], module.summarise_exit)
    monkeypatch.setattr(module, "parts", lambda args, logs: [slow, after])
    assert module.main(["--rehearse", "--logs", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert parts["slow"]["status"] == "timed out" and parts["slow"]["limit_s"] == 1
    assert parts["slow"]["seconds"] < 30  # stopped at its limit, not left to sleep its minute
    assert parts["after"]["status"] == "passed"
    out = capsys.readouterr().out
    assert "| slow | timed out |" in out
