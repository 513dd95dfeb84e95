"""Bad input, as a user types it: one line naming what to fix, exit 2, no traceback, nothing half-made.

Each case runs the installed CLI in a fresh home and working folder, as a user would. A case is the
arguments (``{dir}`` is the working folder, which ``setup`` fills), and a phrase the answer must hold.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from corpus_helpers import build

from tasks.corpus.sample import write_sample


def _files(folder: Path) -> None:
    (folder / "corpus").mkdir()
    (folder / "words.json").write_text("not json at all\n")
    (folder / "other.json").write_text(json.dumps({"name": "a JSON file, not a manifest"}))
    (folder / "binary.json").write_bytes(bytes(range(256)))
    (folder / "a-file").write_text("")


def _copied_manifest(folder: Path) -> None:
    """A corpus's manifest copied out of its store (MLflow keeps such a copy as an artifact)."""
    manifest = build(write_sample(folder / "raw", num_reviews=60), folder / "store")
    source = folder / "store" / "corpora" / manifest.corpus_id / "manifest.json"
    (folder / "elsewhere").mkdir()
    shutil.copy(source, folder / "elsewhere" / "manifest.json")


def _lost_shard(folder: Path) -> None:
    """A corpus in its store with one train shard gone (a half-finished copy, a cleanup gone wrong)."""
    manifest = build(write_sample(folder / "raw", num_reviews=60), folder / "store")
    corpus = (folder / "store" / "corpora" / manifest.corpus_id).rename(folder / "store" / "corpora" / "lost")
    (corpus / manifest.shards("train")[0].path).unlink()


Setup = Callable[[Path], None]
# name: (arguments, phrase the answer holds, setup)
CASES: dict[str, tuple[list[str], str, Setup | None]] = {
    "show a folder": (["corpus", "show", "{dir}/corpus"], "is a folder without a manifest.json", _files),
    "show a non-JSON file": (
        ["corpus", "show", "{dir}/words.json"],
        "words.json is not a corpus manifest",
        _files,
    ),
    "show another JSON file": (["corpus", "show", "{dir}/other.json"], "it has no corpus_id", _files),
    "show a binary file": (
        ["corpus", "show", "{dir}/binary.json"],
        "binary.json is not a corpus manifest",
        _files,
    ),
    "show from S3 without credentials": (
        ["corpus", "show", "s3://no-such-bucket/corpora/x/manifest.json"],
        "set AWS_ACCESS_KEY_ID",
        None,
    ),
    "rejected with a negative limit": (
        ["corpus", "rejected", "--limit", "-5", "{dir}/m.json"],
        "'--limit'",
        None,
    ),
    "sample a negative count": (["corpus", "sample", "--reviews", "-1", "{dir}/out"], "'--reviews'", None),
    "sample into a file": (["corpus", "sample", "{dir}/a-file"], "a-file is a file", _files),
    "build with an empty split": (["corpus", "build", "{dir}/corpus", "--split", "0:0:0"], "split: ", _files),
    "build with no workers": (["corpus", "build", "{dir}/corpus", "--workers", "0"], "--workers: ", _files),
    "build from a path with markup": (["corpus", "build", "{dir}/no[/]such"], "no[/]such", None),
    "plan an infinite GPU": (
        ["plan", "--preset", "tiny", "--batch-size", "8", "--gpu-memory", "inf"],
        "--gpu-memory inf",
        None,
    ),
    "plan a batch the ranks can't share": (
        ["plan", "--preset", "tiny", "--batch-size", "7", "--gpus-per-node", "16"],
        "--batch-size 7 is not divisible by 16 ranks",
        None,
    ),
    "plan a billion nodes": (
        ["plan", "--preset", "tiny", "--batch-size", "1000000000000000000", "--nodes", "1000000000"],
        "the planner takes 1 to 4096 nodes",
        None,
    ),
    "pretrain on a manifest out of its store": (
        ["pretrain", "--corpus", "{dir}/elsewhere/manifest.json"],
        "names train shard",
        _copied_manifest,
    ),
    "pretrain on a corpus missing a shard": (
        ["pretrain", "--corpus", "{dir}/store/corpora/lost"],  # its folder stands for its manifest
        "names train shard",
        _lost_shard,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    arguments, phrase, setup = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    if setup:
        setup(work)
    _refused(arguments, phrase, work, tmp_path / "home")


def test_a_sweep_database_that_does_not_answer_is_one_line_without_its_password(tmp_path: Path) -> None:
    (work := tmp_path / "work").mkdir()
    storage = {
        "MLSTM_SWEEP_STORAGE_URI": "postgresql://optuna:s3cret@127.0.0.1:9/optuna"
    }  # nothing on port 9
    said = _refused(
        ["sweep", "status"],
        "the sweep storage at postgresql://***@127.0.0.1:9/optuna",
        work,
        tmp_path / "home",
        storage,
    )
    assert "s3cret" not in said and "MLSTM_SWEEP_STORAGE_URI" in said


def test_an_mlflow_database_that_does_not_answer_is_one_line_in_seconds_without_its_password(
    tmp_path: Path,
) -> None:
    """MLflow retries a database it cannot reach for about 100 s and quotes the URI; the connection is
    tried once first, for at most ``CONNECT_TIMEOUT`` seconds."""
    (work := tmp_path / "work").mkdir()
    with socket.socket() as probe:  # a loopback port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tracking = {"MLSTM_MLFLOW_TRACKING_URI": f"postgresql://mlflow:s3cret@127.0.0.1:{port}/mlflow"}
    started = time.monotonic()
    said = _refused(
        ["predict", "good"],
        f"the MLflow tracking database at postgresql://***@127.0.0.1:{port}/mlflow does not answer "
        "(Connection refused; 5 s allowed to connect)",
        work,
        tmp_path / "home",
        tracking,
    )
    assert time.monotonic() - started < 30  # the CLI's start included; 108 s before
    assert "s3cret" not in said and "MLSTM_MLFLOW_TRACKING_URI" in said
    # A URI with no host is a Unix socket (the drivers' default): nothing to try over TCP, left to MLflow.
    from tasks.tracking import check_server

    check_server("postgresql://mlflow@/mlflow?host=/var/run/postgresql")


def _refused(
    arguments: list[str], phrase: str, work: Path, home: Path, extra: dict[str, str] | None = None
) -> str:
    """Run the CLI in ``work`` with a fresh ``home``; check the one-line refusal and that nothing was made."""
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    env = {**os.environ, "MLSTM_HOME": str(home), "COLUMNS": "400", **(extra or {})}
    # No credentials anywhere, and no instance metadata service to wait for.
    env |= {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
    env |= {"AWS_EC2_METADATA_DISABLED": "true", "MLSTM_S3_MAX_ATTEMPTS": "1"}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "MLSTM_STORE_URI"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", "from flows.cli import main; main()"]
        + [a.replace("{dir}", str(work)) for a in arguments],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert phrase in said, said
    assert "Traceback" not in said and "pydantic.dev" not in said, said
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if lines[0].startswith("error:"):  # ours; the flag parser's own refusals are its framed message
        assert len(lines) == 1, said
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before  # nothing made or left
    return said


def test_a_pipeline_that_trained_without_validation_prints_its_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A val split shorter than one batch row leaves val_bpc None; the run's result still prints, and a
    path's brackets print as typed."""
    from flows.cli.pipeline import print_pipeline
    from tasks.corpus.result import CorpusResult
    from tasks.pipeline.record import PipelineResult, StageSummary
    from tasks.pretrain.result import PretrainResult

    result = PipelineResult(
        run_id="r1",
        stages={
            "corpus": StageSummary(state="ran", run_id="c"),
            "pretrain": StageSummary(state="ran", run_id="p"),
        },
        corpus=CorpusResult(
            corpus_id="c1",
            manifest_uri="/data/[bold]x[/bold]/manifest.json",
            rows=10,
            duplicates=0,
            rejected=0,
        ),
        pretrain=PretrainResult(
            run="p1",
            run_id="p",
            checkpoint_uri="/store/ckpt",
            steps=20,
            total_steps=20,
            final_loss=1.0,
            val_bpc=None,
        ),
    )
    print_pipeline(result, as_json=False)
    shown = capsys.readouterr().out
    assert "step 20, no val bpc (val split too short)" in shown
    assert "/data/[bold]x[/bold]/manifest.json" in shown
