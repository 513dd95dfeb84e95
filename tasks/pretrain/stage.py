"""Plan, launch and watch a pretraining job: the work behind ``flows/pretrain.py``, without Prefect.

Everything that can be wrong with a launch (an unknown preset, a batch that does not divide among
the ranks, a corpus URI without a manifest, a split too short for the batch) is found here, before
any process starts, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from models.config import PRESETS
from tasks.corpus.manifest import Manifest, ManifestError, NoManifest, check_shards, load_manifest
from tasks.jobs.config import flag_errors
from tasks.jobs.environment import absolute_uri, job_environment
from tasks.jobs.launchers.base import (
    JobSpec,
    LaunchError,
)
from tasks.pretrain.config import PretrainParams, TrainConfig, TrainSettings, run_key
from tasks.pretrain.memory import plan as plan_memory
from tasks.pretrain.parent import Parent, find_parent
from tasks.pretrain.result import PretrainResult
from tasks.settings import Settings
from tasks.store import StoreError, open_store, store_of

log = logging.getLogger(__name__)

# The job torchrun starts for each rank (the launchers run any module they are given).
JOB_MODULE = "tasks.pretrain.train"


class Job(BaseModel):
    """A planned launch: the job's config, how many processes, and where its run lives."""

    config: TrainConfig
    spec: JobSpec
    stop_step: int
    total_steps: int
    corpus_id: str
    parent: Parent | None = None  # a continued run's: the checkpoint --init-from named

    model_config = ConfigDict(arbitrary_types_allowed=True)

    def tracked_by(self, mlflow_run_id: str) -> Job:
        """The same job, logging into an MLflow run the caller opened."""
        config = self.config.model_copy(update={"mlflow_run_id": mlflow_run_id})
        spec = dataclasses.replace(self.spec, args=tuple(config.to_args()))
        return self.model_copy(update={"config": config, "spec": spec})


def plan_job(params: PretrainParams, settings: Settings) -> Job:
    """Check a launch and turn it into a job, reading only the corpus manifest."""
    nproc = params.nproc_per_node
    if params.launcher == "local" and params.nodes != 1:
        raise ValueError(f"--nodes {params.nodes} needs --launcher slurm or kubernetes; local runs one node")
    world_size = params.nodes * nproc
    if (
        params.gpus_per_node and params.preset in PRESETS
    ):  # a launch that cannot fit its GPUs is refused here, not after an OOM
        memory = plan_memory(
            params.preset, nodes=params.nodes, gpus_per_node=params.gpus_per_node, batch_size=params.batch_size,
            seq_len=params.seq_len, sharding=params.sharding, gpu_memory_gib=params.gpu_memory,
            compute_bytes=4 if params.precision == "fp32" else 2, recurrence=params.recurrence,
        )  # fmt: skip
        if not memory.fits:
            raise ValueError(memory.message())
    store_options = {"endpoint_url": settings.s3_endpoint_url, "max_attempts": settings.s3_max_attempts}
    corpus = resolve_corpus(params.corpus, settings)
    manifest = read_corpus_manifest(corpus, **store_options)
    parent = find_parent(params.init_from, settings) if params.init_from else None
    if parent is not None and parent.preset != params.preset:
        raise ValueError(
            f"--init-from {params.init_from} is a {parent.preset} checkpoint ({parent.checkpoint_uri}): "
            f"continue it with --preset {parent.preset}, not {params.preset}"
        )
    # The checkpoints' store fails now, not at the first checkpoint after minutes of training (and after
    # the corpus: a refused launch leaves no folder behind).
    store_of(settings).check_writable()
    from tasks.pretrain.mix import RowPlan, replay_rows, train_sources  # pyarrow: once the manifest is read

    # These raise for a batch that ranks cannot share, a split too short for it, or a replay share that
    # is no row or every row.
    reads = train_sources(params, manifest, parent, **store_options)
    rows = replay_rows(params.batch_size, params.replay, params.seed)
    plan = RowPlan(reads.fresh_bytes, reads.replay_bytes, params.batch_size, params.seq_len, rows, world_size)
    total_steps = params.total_steps or plan.steps_per_epoch
    if params.warmup_steps >= total_steps:  # the rate would never reach --lr: refused before any work
        length = (
            "--total-steps"
            if params.total_steps
            else f"one pass over the {'new' if parent else 'train'} data"
        )
        raise ValueError(
            f"--warmup-steps {params.warmup_steps} is not shorter than the schedule's {total_steps} steps "
            f"({length}): the learning rate would never reach --lr; lower it, or warm up over a share of the "
            "schedule with --warmup-share"
        )
    corpus_id = manifest.corpus_id
    if params.run:
        run = params.run
    elif parent is not None:  # named by its identity: the same parent, corpus and settings find this run
        run = f"{params.preset}-{corpus_id[:8]}-{run_key(params, corpus_id, parent.digest)[:8]}"
    else:
        run = default_run_name(params.preset, corpus_id)
    store_uri = absolute_uri(settings.resolved_store_uri)
    # The training settings pass through as they are; where the run lives is the flow's to fill in.
    settings_of_training = params.model_dump(include=set(TrainSettings.model_fields))
    try:
        config = TrainConfig(
            **{
                **settings_of_training,
                "total_steps": total_steps,
                # The step folder the name resolved to: a resume refuses a run whose parent moved (champion).
                **({"init_from": parent.checkpoint_uri} if parent else {}),
            },
            corpus=absolute_uri(corpus),
            run_name=run,
            store=store_uri,
        )
    except ValidationError as error:
        raise ValueError(flag_errors(error)) from None
    spec = JobSpec(
        name=run,
        args=tuple(config.to_args()),
        module=JOB_MODULE,
        nodes=params.nodes,
        nproc_per_node=nproc,
        gpus_per_node=params.gpus_per_node,
        env=job_environment(settings, params.launcher),
        workdir=(settings.home / "jobs").resolve(),
    )
    stop = min(total_steps, params.max_steps or total_steps)
    return Job(
        config=config, spec=spec, stop_step=stop, total_steps=total_steps, corpus_id=corpus_id, parent=parent
    )


def resolve_corpus(uri: str, settings: Settings) -> str:
    """``newest`` is the corpus published last in the store; any other URI is itself."""
    if uri != "newest":
        return uri
    from tasks.corpus.manifest import newest_manifest

    found = newest_manifest(store_of(settings))
    if found is None:
        raise ValueError(f"--corpus newest: no corpus is published in {settings.resolved_store_uri}")
    return found


def read_corpus_manifest(uri: str, **store_options: Any) -> Manifest:
    """The corpus's manifest, with every train and val shard it names in the store: a job that would
    fail on a missing file is refused here, once, not launched and retried."""
    try:
        store, key, manifest = load_manifest(uri, **store_options)
        if "train" not in manifest.splits:
            raise ManifestError("the manifest has no train split")
        check_shards(store, key, manifest, ("train", "val"))
    except (NoManifest, StoreError, OSError):
        raise ValueError(
            f"--corpus {uri}: no corpus manifest there; pass the manifest_uri that "
            "`mlstm-sentiment corpus build` printed (…/corpora/<id>/manifest.json)"
        ) from None
    except ManifestError as error:
        raise ValueError(f"--corpus {uri}: {error}") from None
    return manifest


def default_run_name(preset: str, corpus_id: str) -> str:
    return f"{preset}-{corpus_id[:8]}-{datetime.now(UTC):%Y%m%d-%H%M%S}"


def open_mlflow_run(
    job: Job, settings: Settings, tags: dict[str, str], parent_run_id: str | None = None
) -> str:
    """The MLflow run the job logs into: the run's own when it resumes, else a new one (a child of
    ``parent_run_id``, a pipeline's run, when given)."""
    from mlflow.tracking import MlflowClient

    from tasks.jobs.checkpoint import read_latest
    from tasks.tracking import connect, run_exists

    experiment = connect(settings)
    client = MlflowClient()
    store = open_store(job.config.store or settings.resolved_store_uri, endpoint_url=settings.s3_endpoint_url)
    latest = read_latest(store, job.config.run_name)
    if latest and latest.get("mlflow_run_id"):
        old_run_id = str(latest["mlflow_run_id"])
        if run_exists(old_run_id):
            for key, value in tags.items():
                client.set_tag(old_run_id, key, value)
            return old_run_id
        # The server changed or its database was reset: the weights resume, the record starts anew.
        tags = {
            **tags,
            "resumed_from_run_id": old_run_id,
            "resumed_from_checkpoint": latest["checkpoint_uri"],
        }
        log.warning(
            "run %s: MLflow run %s is not at %s; resuming %s into a new MLflow run tagged with both",
            job.config.run_name,
            old_run_id,
            settings.shown_mlflow_tracking_uri,
            latest["checkpoint_uri"],
        )
    if parent_run_id:
        tags = {**tags, "mlflow.parentRunId": parent_run_id}
    run = client.create_run(experiment.experiment_id, run_name=f"pretrain-{job.config.run_name}", tags=tags)
    return str(run.info.run_id)


def job_result(job: Job, settings: Settings) -> PretrainResult:
    """What the CLI prints: read from the run's ``latest.json``, which the job writes last."""
    from tasks.jobs.checkpoint import read_latest

    store = open_store(job.config.store or settings.resolved_store_uri, endpoint_url=settings.s3_endpoint_url)
    latest = read_latest(store, job.config.run_name)
    if latest is None:
        raise LaunchError(f"run {job.config.run_name} ended without a checkpoint")
    return PretrainResult.from_latest(job.config.run_name, latest)
