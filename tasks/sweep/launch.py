"""A trial's launch without Prefect: plan, open its MLflow run, run the job, read its result.

The flow launches trials as ``pretrain`` subflow runs instead (GPU slot, retries, artifacts); this is
the same job through the same launcher, for the benchmark and for scripts that have no Prefect API.
"""

from __future__ import annotations

from typing import Any

from tasks.pretrain.launchers import launcher_for
from tasks.pretrain.stage import PretrainParams, job_result, open_mlflow_run, plan_job, watch
from tasks.settings import Settings


def launch_here(
    params: PretrainParams, settings: Settings, *, parent_run_id: str | None = None
) -> dict[str, Any]:
    """Run one launch of the pretraining job to its end; a crash raises ``LaunchError``."""
    job = plan_job(params, settings)
    tags = {"stage": "pretrain", "run": job.config.run_name, "corpus_id": job.corpus_id}
    job = job.tracked_by(open_mlflow_run(job, settings, tags, parent_run_id))
    launcher = launcher_for(params.launcher)
    handle = launcher.submit(job.spec)
    finished = False
    try:
        watch(launcher, handle, on_line=lambda line: None, on_progress=lambda values: None, poll_seconds=0.2)
        finished = True
    finally:
        if not finished:
            launcher.cancel(handle)
    return job_result(job, settings)
