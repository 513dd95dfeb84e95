"""The pretraining flow: plan the job, launch it, follow rank 0's log, relaunch after a crash.

A relaunch uses the same run name, so the job resumes from ``latest.json``: a Prefect retry of the
``train`` task is a resume, never a restart. Cancelling the flow run cancels the job (torchrun's
process group, the Slurm job or the Kubernetes training job): no process outlives the run.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.exceptions import TerminationSignal

from flows import names, progress
from flows.runtime import retry_unless
from tasks.pretrain import joblog
from tasks.pretrain.config import PretrainParams
from tasks.pretrain.launchers import launcher_for
from tasks.pretrain.launchers.base import JobError, JobFailed, JobHandle, JobSpec, Launcher
from tasks.pretrain.stage import Job, job_result, open_mlflow_run, plan_job, watch
from tasks.settings import get_settings
from tasks.tracking import experiment_id, run_link


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Turn SIGTERM into Prefect's TerminationSignal, so the ``finally`` that cancels the job runs, and a
    cancelled deployment run (the worker's SIGTERM) ends Cancelled, not Crashed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise TerminationSignal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def gpu_slot(limit: str) -> Iterator[None]:
    """Hold a slot of the global concurrency limit ``limit`` (made by `mlstm-sentiment deploy`), so two
    pretraining jobs never share the GPUs, whichever deployment or user started them. Without the
    limit (the embedded API of a laptop run) nothing is held."""
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(limit)
        except ObjectNotFound:
            get_run_logger().info(
                "no concurrency limit %r on this Prefect server: not waiting for one", limit
            )
            yield
            return
    get_run_logger().info("waiting for a slot of concurrency limit %r", limit)
    with concurrency(limit, occupy=1, strict=True):
        yield


# A crash (a killed rank, a lost node) is relaunched; an error the job reported itself is not.
_worth_relaunching = retry_unless(JobError)


def _log_line(logger: Any, line: str) -> None:
    """A line of the job's log into the flow run's: its warnings as warnings, so that the terminal shows
    them too (a damaged checkpoint skipped, fp16 steps skipped)."""
    if line.startswith(joblog.WARNING_PREFIX):
        logger.warning("%s", line.removeprefix(joblog.WARNING_PREFIX))
    else:
        logger.info("%s", line)


def launch_and_watch(
    launcher: Launcher, spec: JobSpec, on_progress: Callable[[dict[str, float]], None]
) -> None:
    """Submit a job and follow rank 0's log into the flow run's to the job's end; a job still running
    when this is interrupted (SIGTERM, a cancelled flow run) is cancelled: no process outlives it."""
    logger = get_run_logger()
    handle: JobHandle | None = None
    finished = False
    try:
        with terminate_raises():
            handle = launcher.submit(spec)
            logger.info("submitted %s job %s (log: %s)", launcher.name, handle.job_id, handle.log_path or "-")
            try:
                watch(launcher, handle, on_line=functools.partial(_log_line, logger), on_progress=on_progress)
            except JobFailed:  # it has ended: there is nothing to stop
                finished = True
                raise
            finished = True
    finally:
        if handle is not None and not finished:
            logger.warning("stopping %s job %s", launcher.name, handle.job_id)
            launcher.cancel(handle)


@task(name="train", cache_policy=NO_CACHE, retry_condition_fn=_worth_relaunching)
def train(job: Job, launcher: Launcher) -> dict[str, Any]:
    """One launch of the job, followed to its end; a retry of this task resumes from ``latest``."""
    sink = progress.current()
    artifact_id = create_progress_artifact(
        progress=0.0, key="training-progress", description=f"run {job.config.run_name}: steps done"
    )
    rows: list[dict[str, float]] = []
    done = 0.0

    def on_progress(values: dict[str, float]) -> None:
        nonlocal done
        rows.append(values)
        sink.advance(values["step"] - done)
        done = values["step"]
        update_progress_artifact(artifact_id, progress=100 * values["step"] / job.stop_step)  # type: ignore[arg-type]  # sync: a UUID

    launch_and_watch(launcher, job.spec, on_progress)
    if rows:
        columns = ("step", "loss", "bpc", "lr", "chars_per_s")
        create_table_artifact(
            key="training-log",
            table=[{c: row.get(c) for c in columns} for row in rows[-50:]],
            description=f"run {job.config.run_name}: the last progress lines of this launch",
        )
    return job_result(job, get_settings())


@flow(name="pretrain", flow_run_name=names.pretrain_name)
def pretrain(params: PretrainParams, parent_run_id: str | None = None) -> dict[str, Any]:
    """Train the mLSTM on a corpus: local torchrun, Slurm or Kubernetes; resumable by run name.

    Args:
        params: What to train and how.
        parent_run_id: MLflow run (a pipeline's) that a new training run is a child of.
    """
    settings = get_settings()
    job = plan_job(params, settings)  # fails here, before any process, on bad settings
    flow_run_id = str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    tags = {
        "stage": "pretrain",
        "run": job.config.run_name,
        "corpus_id": job.corpus_id,
        "manifest_uri": job.config.corpus,
        "prefect_flow_run_id": flow_run_id,
    }
    job = job.tracked_by(open_mlflow_run(job, settings, tags, parent_run_id))
    progress.current().stage(f"training {job.config.preset}", total=job.stop_step)
    with gpu_slot(settings.pretrain_concurrency_limit):
        result = train.with_options(retries=params.retries, retry_delay_seconds=5)(
            job, launcher_for(params.launcher)
        )
    create_markdown_artifact(
        key="pretrain-result",
        markdown=(
            f"# Pretraining run `{result['run']}`\n\n"
            f"- step {result['steps']} of {result['total_steps']}, loss {result['final_loss']:.4f}, "
            f"val bpc {result['val_bpc']}\n- checkpoint: `{result['checkpoint_uri']}`\n"
            f"- MLflow run: {run_link(settings, experiment_id(settings), result['run_id'])}\n"
        ),
        description="Where the checkpoint and the MLflow run are",
    )
    return result
