"""The pretraining flow: plan the job, launch it, follow rank 0's log, relaunch after a crash.

A relaunch uses the same run name, so the job resumes from ``latest.json``: a Prefect retry of the
``train`` task is a resume, never a restart. Cancelling the flow run cancels the job (torchrun's
process group, the Slurm job or the Kubernetes training job): no process outlives the run.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from flows import names, progress
from flows.jobs import gpu_slot, launch_and_watch, worth_relaunching
from tasks.jobs.launchers import launcher_for
from tasks.jobs.launchers.base import Launcher
from tasks.pretrain.config import PretrainParams
from tasks.pretrain.result import PretrainResult
from tasks.pretrain.stage import Job, job_result, open_mlflow_run, plan_job
from tasks.settings import get_settings
from tasks.tracking import experiment_id, run_link


@task(name="train", cache_policy=NO_CACHE, retry_condition_fn=worth_relaunching)
def train(job: Job, launcher: Launcher) -> PretrainResult:
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


def continued_from(job: Job) -> str:
    """The artifact's line on a continued run's parent (none for a run from its own seed)."""
    if job.parent is None:
        return ""
    parent = job.parent
    replay = (
        f", replaying {job.config.replay:.0%} of its corpus `{parent.corpus}`" if job.config.replay else ""
    )
    return f"- continued from checkpoint `{parent.checkpoint_uri}` (run {parent.run}, step {parent.step}){replay}\n"


@flow(name="pretrain", flow_run_name=names.pretrain_name)
def pretrain(params: PretrainParams, parent_run_id: str | None = None) -> PretrainResult:
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
        **(job.parent.tags() if job.parent else {}),  # a continued run's lineage
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
            f"# Pretraining run `{result.run}`\n\n"
            f"- step {result.steps} of {result.total_steps}, loss {result.final_loss:.4f}, "
            f"val bpc {result.val_bpc}\n- checkpoint: `{result.checkpoint_uri}`\n"
            f"{continued_from(job)}"
            f"- MLflow run: {run_link(settings, experiment_id(settings), str(result.run_id))}\n"
        ),
        description="Where the checkpoint and the MLflow run are",
    )
    return result
