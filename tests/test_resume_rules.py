"""What a resume restores and what it refuses, on one CPU rank (the 2-rank, bit-for-bit version is
test_pretrain.py::test_two_ranks_equal_one_rank_and_a_resumed_run_the_uninterrupted_one, marked slow).

The rules (tasks/jobs/checkpointer.py, ``Checkpointer.resume``; ``TrainConfig.run_settings``):
relaunching a run by its name continues from its newest checkpoint with the weights, Adam's state, the
learning-rate schedule, the carried state and the step count it saved; a setting the numbers depend on
(``run_settings``) may not change, and the error names it; a setting of how the job runs (how often it
logs, say) may."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import job, run_job

from tasks.jobs.checkpoint import load_checkpoint

FAST = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--lr", "0.003", "--total-steps", "12"]


@pytest.mark.long  # three runs of the job; test_pretrain's resume test guards the restore in CI
def test_a_resume_restores_the_whole_state_and_refuses_a_changed_setting(
    sample_manifest: str, home: Path
) -> None:
    common = ["--corpus", sample_manifest, "--store", str(home / "store"), *FAST, "--checkpoint-every", "6"]
    straight = run_job([*common, "--run-name", "straight", "--max-steps", "12"], home, name="straight")
    half = run_job([*common, "--run-name", "halves", "--max-steps", "6"], home, name="half")
    assert half["steps"] == 6

    # A setting the numbers depend on is refused, by name, before any step.
    launcher, handle = job([*common, "--run-name", "halves", "--lr", "0.002"], home, name="changed")
    status = launcher.wait(handle, poll_seconds=0.2, timeout=300)
    log = Path(handle.log_path).read_text()
    assert status.exit_code != 0, log
    assert "was started with other settings (--lr was 0.003, now 0.002)" in log

    # How often it logs is not such a setting: the relaunch resumes at step 6 and ends where a straight
    # run ends, weights, Adam's moments, the schedule and the carried state alike.
    launcher, handle = job([*common, "--run-name", "halves", "--log-every", "3"], home, name="resumed")
    status = launcher.wait(handle, poll_seconds=0.2, timeout=300)
    log = Path(handle.log_path).read_text()
    assert status.exit_code == 0, log
    assert "resumed run halves from step 6" in log  # not a new run that happens to end the same
    resumed = json.loads(log.rpartition("result ")[2].splitlines()[0])
    assert resumed["steps"] == 12
    assert abs(resumed["final_loss"] - straight["final_loss"]) <= 1e-6
    a = load_checkpoint(straight["checkpoint_uri"]).state
    b = load_checkpoint(resumed["checkpoint_uri"]).state
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=0, atol=1e-6, msg=name)
    for key in ("h", "c"):
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)
    assert b["schedule"] == a["schedule"]
    moments = [(s["exp_avg"], s["exp_avg_sq"]) for s in a["optimizer"]["state"].values()]
    for (m, v), s in zip(moments, b["optimizer"]["state"].values(), strict=True):
        torch.testing.assert_close(s["exp_avg"], m, rtol=0, atol=1e-6)
        torch.testing.assert_close(s["exp_avg_sq"], v, rtol=0, atol=1e-8)
