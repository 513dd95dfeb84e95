"""The engines users meet: MLflow's own settings, a resume whose MLflow run is gone, a store checked
before any work."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.settings import get_settings

CLI = str(Path(sys.executable).parent / "mlstm-sentiment")


def test_mlflow_own_variables_are_honoured_below_ours(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLSTM_MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLSTM_MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    settings = get_settings()
    assert settings.mlflow_tracking_uri_source == (
        f"sqlite:///{tmp_path / 'elsewhere.db'}",
        "MLFLOW_TRACKING_URI",
    )
    assert settings.resolved_mlflow_registry_uri == settings.resolved_mlflow_tracking_uri

    monkeypatch.setenv("MLFLOW_REGISTRY_URI", f"sqlite:///{tmp_path / 'registry.db'}")
    monkeypatch.setenv("MLSTM_MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'ours.db'}")
    settings = get_settings()
    assert settings.mlflow_tracking_uri_source == (
        f"sqlite:///{tmp_path / 'ours.db'}",
        "MLSTM_MLFLOW_TRACKING_URI",
    )
    assert settings.mlflow_registry_uri_source == (
        f"sqlite:///{tmp_path / 'registry.db'}",
        "MLFLOW_REGISTRY_URI",
    )

    # The command says which source won, and a run logs where MLflow's variable points.
    env = {k: v for k, v in os.environ.items() if k != "MLSTM_MLFLOW_TRACKING_URI"}
    shown = json.loads(
        subprocess.run([CLI, "settings"], env=env, capture_output=True, text=True, check=True).stdout
    )
    assert shown["mlflow_tracking_uri_from"] == "MLFLOW_TRACKING_URI"
    assert shown["resolved_mlflow_tracking_uri"] == f"sqlite:///{tmp_path / 'elsewhere.db'}"
    assert shown["mlflow_registry_uri_from"] == "MLFLOW_REGISTRY_URI"
    # Where the checkpoint key comes from, never the key itself.
    assert (shown["checkpoint_key_from"], shown["checkpoint_key"]) == ("MLSTM_CHECKPOINT_KEY", "**********")

    import mlflow

    from tasks.tracking import mlflow_run

    monkeypatch.delenv("MLSTM_MLFLOW_TRACKING_URI")
    with mlflow_run(get_settings(), run_name="where", tags={}) as run:
        pass
    assert (tmp_path / "elsewhere.db").exists() and not (home / "mlflow.db").exists()
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path / 'elsewhere.db'}").get_run(run.info.run_id)


def test_a_resume_whose_mlflow_run_is_gone_starts_a_new_tagged_run(
    sample_manifest: str, home: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    from tasks.pretrain.config import PretrainParams
    from tasks.pretrain.stage import open_mlflow_run, plan_job
    from tasks.store import open_store

    uri = f"sqlite:///{tmp_path / 'reset.db'}"
    settings = get_settings(mlflow_tracking_uri=uri)
    job = plan_job(PretrainParams(corpus=sample_manifest, run="gone", batch_size=4, seq_len=16), settings)
    gone = "0123456789abcdef0123456789abcdef"  # a run of the server before its database was reset
    checkpoint = f"{settings.resolved_store_uri}/runs/gone/checkpoints/step-0000010"
    latest = {"mlflow_run_id": gone, "checkpoint_uri": checkpoint, "step": 10}
    open_store(settings.resolved_store_uri).write_bytes("runs/gone/latest.json", json.dumps(latest).encode())

    with caplog.at_level(logging.WARNING):
        run_id = open_mlflow_run(job, settings, {"stage": "pretrain"})
    run = MlflowClient(uri).get_run(run_id)
    assert run_id != gone
    assert run.data.tags["resumed_from_run_id"] == gone
    assert run.data.tags["resumed_from_checkpoint"] == checkpoint
    assert run.data.tags["stage"] == "pretrain"
    lines = [r.getMessage() for r in caplog.records if gone in r.getMessage()]
    assert len(lines) == 1 and checkpoint in lines[0]

    # The same run resumes into its new MLflow run once latest.json names it.
    latest["mlflow_run_id"] = run_id
    open_store(settings.resolved_store_uri).write_bytes("runs/gone/latest.json", json.dumps(latest).encode())
    assert open_mlflow_run(job, settings, {"stage": "pretrain"}) == run_id


def test_the_job_itself_starts_a_new_run_when_its_run_id_is_gone(home: Path, tmp_path: Path) -> None:
    import mlflow

    from tasks.tracking import start_tracking

    settings = get_settings(mlflow_tracking_uri=f"sqlite:///{tmp_path / 'reset.db'}")
    gone = "fedcba9876543210fedcba9876543210"
    run = start_tracking(settings, run_id=gone, run_name="pretrain-gone", tags={"stage": "pretrain"})
    mlflow.end_run()
    assert run.info.run_id != gone and run.data.tags["resumed_from_run_id"] == gone


@pytest.mark.slow
def test_a_store_that_cannot_be_written_fails_before_any_source_is_read(
    s3_server: str, home: Path, tmp_path: Path
) -> None:
    import uuid

    import boto3

    from tasks.corpus.sample import write_sample

    files = write_sample(tmp_path / "raw", num_reviews=50)
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "MLSTM_S3_ENDPOINT_URL": s3_server}
    command = [CLI, "corpus", "build", str(tmp_path / "raw"), "--store", f"s3://{bucket}/corpora"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    # No work before the error: no piece was parsed (without the check, each parse task fails its upload).
    assert "Task run" not in done.stderr and "parse" not in done.stderr, done.stderr
    message = " ".join(done.stderr.split())
    assert bucket in message and s3_server in message
    assert (
        "MLSTM_STORE_URI" in message and "MLSTM_S3_ENDPOINT_URL" in message and "--create-bucket" in message
    )

    done = subprocess.run(
        [*command, "--create-bucket", "--json"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket=bucket)["Contents"]
    ]
    assert any(k.endswith("manifest.json") for k in keys) and not any("write-check" in k for k in keys)
    assert files


def test_a_store_folder_that_cannot_be_made_is_one_clear_error(tmp_path: Path) -> None:
    from tasks.store import StoreError, open_store

    (tmp_path / "a-file").write_text("")
    with pytest.raises(StoreError, match=r"a-file.*MLSTM_STORE_URI"):
        open_store(str(tmp_path / "a-file" / "store")).check_writable()


def test_a_training_run_whose_store_cannot_be_written_fails_before_any_process(
    s3_server: str, sample_manifest: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uuid

    from tasks.pretrain.config import PretrainParams
    from tasks.pretrain.stage import plan_job
    from tasks.store import StoreError

    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("MLSTM_S3_ENDPOINT_URL", s3_server)
    settings = get_settings(store_uri=f"s3://{bucket}/runs")
    params = PretrainParams(corpus=sample_manifest, run="nowhere", batch_size=4, seq_len=16)
    # Checked when the job is planned (before torchrun, Slurm or Kubernetes start anything), not when
    # the first checkpoint is written.
    with pytest.raises(StoreError, match=rf"{bucket}.*does not exist.*MLSTM_STORE_URI"):
        plan_job(params, settings)


def test_a_task_retries_what_may_pass_and_not_what_the_same_input_raises_again() -> None:
    """The retry rule the corpus, pretrain and score flows share (``flows.runtime.retry_unless``)."""
    from flows.runtime import retry_unless
    from tasks.corpus.sources import SourceError
    from tasks.jobs.launchers.base import JobError, JobFailed

    class Ended:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def result(self) -> None:
            raise self.error

    corpus, pretrain = retry_unless(SourceError), retry_unless(JobError)
    assert corpus(None, None, Ended(ConnectionError("reset"))) and not corpus(
        None, None, Ended(SourceError("gone"))
    )
    assert pretrain(None, None, Ended(JobFailed("torchrun exited with 1")))  # a crash: relaunched
    assert not pretrain(None, None, Ended(JobError("the loss is nan")))  # the job's own error: not
