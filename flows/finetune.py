"""The fine-tuning flow: plan the job, launch it (torchrun, Slurm or Kubernetes), follow rank 0's log,
relaunch after a crash (a resume from ``latest.json``), then register the classifier as a challenger.

The work is in tasks/finetune/ (plain functions); the launch and the watching are every job's
(``flows.jobs.launch_and_watch``).
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from flows import names, progress
from flows.jobs import launch_and_watch, worth_relaunching
from tasks.finetune.config import FinetuneParams
from tasks.finetune.result import FinetuneJobResult, FinetuneResult
from tasks.finetune.stage import Job, job_result, model_card, open_mlflow_run, plan_job, register_result
from tasks.jobs.launchers import launcher_for
from tasks.jobs.launchers.base import Launcher
from tasks.settings import get_settings


@task(name="finetune-train", cache_policy=NO_CACHE, retry_condition_fn=worth_relaunching)
def train(job: Job, launcher: Launcher) -> FinetuneJobResult:
    """One launch of the job, followed to its end; a retry of this task resumes from ``latest``."""
    sink = progress.current()
    done = 0.0

    def on_progress(values: dict[str, float]) -> None:
        nonlocal done
        sink.advance(values["step"] - done)
        done = values["step"]

    launch_and_watch(launcher, job.spec, on_progress)
    return job_result(job, get_settings())


@task(name="finetune-register", cache_policy=NO_CACHE)
def register(job: Job, result: FinetuneJobResult, compare: bool) -> FinetuneResult:
    """The frozen probe and the baseline beside it; the pyfunc logged and registered."""
    return register_result(job, result, get_settings(), compare=compare)


@flow(name="finetune", flow_run_name=names.finetune_name)
def finetune(params: FinetuneParams, parent_run_id: str | None = None) -> FinetuneResult:
    """Fine-tune the mLSTM and a head on a labelled dataset; register the result as a challenger.

    Args:
        params: The checkpoint, the dataset, the settings and the launch.
        parent_run_id: MLflow run (a pipeline's) that the fine-tuning run is a child of.
    """
    settings = get_settings()
    job = plan_job(params, settings)  # fails here, before any process, on bad settings or data
    flow_run_id = str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    tags = {
        "stage": "finetune",
        "run": job.config.run_name,
        "checkpoint_uri": job.config.checkpoint,
        "dataset_checksum": job.dataset_checksum,
        "prefect_flow_run_id": flow_run_id,
    }
    job = job.tracked_by(open_mlflow_run(job, settings, tags, parent_run_id))
    progress.current().stage(f"fine-tuning on {job.dataset_name}", total=job.total_steps)
    result = train.with_options(retries=params.retries, retry_delay_seconds=5)(
        job, launcher_for(params.launcher)
    )
    progress.current().stage("registering", total=1)
    registered = register(job, result, params.baseline)
    create_markdown_artifact(
        key="finetune-result",
        markdown=f"# Fine-tuning run `{job.config.run_name}`\n\n{model_card(registered.report)}\n"
        f"Registered v{registered.registered.version}: {registered.registered.reason}.\n",
        description="The fine-tuned classifier beside the probe and the baseline",
    )
    return registered
