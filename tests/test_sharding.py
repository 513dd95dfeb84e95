"""--sharding none|optimizer|full: the same losses as DDP, a share of Adam's state per rank, and
checkpoints that resume at another world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import job

from tasks.pipeline import pretrain_key
from tasks.pretrain.checkpoint import load_checkpoint
from tasks.pretrain.sharding import wrap
from tasks.pretrain.stage import PretrainParams
from tasks.pretrain.train import iter_progress

FAST = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--lr", "0.003", "--log-every", "1"]


def run(args: list[str], home: Path, *, nproc: int, name: str) -> tuple[list[dict[str, float]], str]:
    """The job's progress lines (one a step) and its last checkpoint's URI."""
    launcher, handle = job(args, home, nproc=nproc, name=name)
    status = launcher.wait(handle, poll_seconds=0.2, timeout=300)
    log = Path(handle.log_path).read_text()
    assert status.exit_code == 0, log
    uri = log.rpartition("checkpoint step=")[2].split("uri=")[1].split()[0]
    return list(iter_progress(iter(log.splitlines()))), uri


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["optimizer", "full"])
def test_a_sharding_trains_as_ddp_with_a_share_of_adams_state(
    sharding: str, sample_manifest: str, home: Path
) -> None:
    common = ["--corpus", sample_manifest, "--store", str(home / "store"), *FAST, "--max-steps", "20"]
    ddp, _ = run([*common, "--run-name", "ddp", "--sharding", "none"], home, nproc=2, name="ddp")
    sharded, _ = run([*common, "--run-name", sharding, "--sharding", sharding], home, nproc=2, name=sharding)
    assert len(sharded) == len(ddp) == 20
    for a, b in zip(ddp, sharded, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a["step"], a["loss"], b["loss"])
    ratio = sharded[-1]["optimizer_bytes"] / ddp[-1]["optimizer_bytes"]
    assert 0.4 <= ratio <= 0.6, ratio


@pytest.mark.slow
def test_a_full_checkpoint_at_two_ranks_resumes_at_one(sample_manifest: str, home: Path) -> None:
    common = ["--corpus", sample_manifest, "--store", str(home / "store"), *FAST, "--checkpoint-every", "100"]
    straight, straight_uri = run(
        [*common, "--run-name", "straight", "--max-steps", "16"], home, nproc=1, name="a"
    )
    run([*common, "--run-name", "halves", "--max-steps", "8", "--sharding", "full"], home, nproc=2, name="b")
    resumed, resumed_uri = run(
        [*common, "--run-name", "halves", "--max-steps", "16"], home, nproc=1, name="c"
    )
    assert resumed[-1]["step"] == 16
    assert resumed[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-5)
    a, b = load_checkpoint(straight_uri).state, load_checkpoint(resumed_uri).state
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert len(b["optimizer"]["state"]) == len(a["optimizer"]["state"])  # whole, not a shard


def test_the_sharding_is_a_setting_of_the_launch_not_of_the_run() -> None:
    """The pipeline finds (and resumes) the same run whatever --sharding a relaunch gives."""
    params = PretrainParams(corpus="c")
    key = pretrain_key(params, "corpus-id")
    assert pretrain_key(params.model_copy(update={"sharding": "full"}), "corpus-id") == key
    assert pretrain_key(params.model_copy(update={"lr": 1e-3}), "corpus-id") != key


def test_full_sharding_refuses_fp16_with_what_to_use() -> None:
    with pytest.raises(ValueError, match="--precision bf16 or fp32"):
        wrap(
            torch.nn.Linear(2, 2),
            "full",
            world_size=2,
            device=torch.device("cpu"),
            dtype=torch.float16,
            lr=1e-3,
        )
