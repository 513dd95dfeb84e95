"""The fine-tuning stage without Prefect: plan the job, launch and watch it (the pretraining stage's
launchers and watcher), then log and register its classifier as a challenger.

    plan_job(params)         → a Job: every input checked (checkpoint, dataset, store) before any process
    open_mlflow_run(job)     → the run the job logs its epochs into (the run's own on a resume)
    job_result(job)          → the job's ``result.json``: the epoch best on dev, its test accuracy
    register_result(result)  → the frozen probe and the TF-IDF baseline of the same splits beside it,
                               the pyfunc logged, a version registered; the champion rule decides
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, ValidationError

from tasks.finetune.config import (
    FinetuneConfig,
    FinetuneParams,
    FinetuneSettings,
    flag_errors,
    weight_settings,
)
from tasks.finetune.result import FinetuneJobResult, FinetuneReport, FinetuneResult, FrozenProbe
from tasks.jobs.environment import absolute_uri, job_environment
from tasks.jobs.launchers.base import JobSpec, LaunchError
from tasks.settings import Settings
from tasks.store import store_of
from tasks.transfer.datasets import Dataset, load_dataset
from tasks.transfer.result import BaselineReport

JOB_MODULE = "tasks.finetune.train"


class Job(BaseModel):
    """A planned launch: the job's config and its processes."""

    config: FinetuneConfig
    spec: JobSpec
    total_steps: int
    dataset_name: str
    dataset_checksum: str

    model_config = ConfigDict(arbitrary_types_allowed=True)

    def tracked_by(self, mlflow_run_id: str) -> Job:
        config = self.config.model_copy(update={"mlflow_run_id": mlflow_run_id})
        spec = dataclasses.replace(self.spec, args=tuple(config.to_args()))
        return self.model_copy(update={"config": config, "spec": spec})


def check_dataset(params: FinetuneParams) -> Dataset:
    """The labelled data, read and checked: a file without a label column, a split with one class, an
    empty text each fail here in one line naming the file (``DatasetError``), before any process."""
    return load_dataset(params.dataset, text_column=params.text_column, label_column=params.label_column)


def plan_job(params: FinetuneParams, settings: Settings) -> Job:
    """Check a launch and turn it into a job."""
    from tasks.transfer.stage import resolve_checkpoint

    if params.launcher == "local" and params.nodes != 1:
        raise ValueError(f"--nodes {params.nodes} needs --launcher slurm or kubernetes; local runs one node")
    checkpoint = resolve_checkpoint(params.checkpoint, settings)
    dataset = check_dataset(params)
    world_size = params.nodes * params.nproc_per_node
    if params.batch_size % world_size:
        raise ValueError(f"--batch-size {params.batch_size} is not a multiple of the {world_size} ranks")
    if len(dataset.train) < params.batch_size:
        raise ValueError(
            f"--batch-size {params.batch_size} is larger than the {len(dataset.train)} train rows of {dataset.source}"
        )
    store_of(settings).check_writable()
    run = params.run or default_run_name(dataset.name)
    steps_per_epoch = len(dataset.train) // params.batch_size
    try:
        config = FinetuneConfig(
            **params.model_dump(include=set(FinetuneSettings.model_fields)),
            checkpoint=absolute_uri(checkpoint),
            dataset=_absolute_spec(params.dataset),
            text_column=params.text_column,
            label_column=params.label_column,
            run_name=run,
            store=absolute_uri(settings.resolved_store_uri),
        )
    except ValidationError as error:
        raise ValueError(flag_errors(error)) from None
    spec = JobSpec(
        name=run,
        args=tuple(config.to_args()),
        nodes=params.nodes,
        nproc_per_node=params.nproc_per_node,
        gpus_per_node=params.gpus_per_node,
        module=JOB_MODULE,
        env=job_environment(settings, params.launcher),
        workdir=(settings.home / "jobs").resolve(),
    )
    return Job(
        config=config,
        spec=spec,
        total_steps=params.epochs * steps_per_epoch,
        dataset_name=dataset.name,
        dataset_checksum=dataset.checksum,
    )


def _absolute_spec(spec: str) -> str:
    """NAME=PATH with PATH absolute: ranks may start in another folder."""
    name, sep, path = spec.rpartition("=")
    return f"{name}{sep}{absolute_uri(path)}"


def default_run_name(dataset: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", dataset)
    return f"finetune-{safe}-{datetime.now(UTC):%Y%m%d-%H%M%S}"


def open_mlflow_run(
    job: Job, settings: Settings, tags: dict[str, str], parent_run_id: str | None = None
) -> str:
    """The MLflow run the job logs into: the run's own when it resumes, else a new one."""
    from mlflow.tracking import MlflowClient

    from tasks.finetune.train import finetune_store
    from tasks.jobs.checkpoint import read_latest
    from tasks.tracking import connect, run_exists

    experiment = connect(settings)
    client = MlflowClient()
    latest = read_latest(
        finetune_store(job.config.store or settings.resolved_store_uri, settings), job.config.run_name
    )
    if latest and latest.get("mlflow_run_id") and run_exists(str(latest["mlflow_run_id"])):
        return str(latest["mlflow_run_id"])
    if parent_run_id:
        tags = {**tags, "mlflow.parentRunId": parent_run_id}
    run = client.create_run(experiment.experiment_id, run_name=f"finetune-{job.config.run_name}", tags=tags)
    return str(run.info.run_id)


def job_result(job: Job, settings: Settings) -> FinetuneJobResult:
    """The job's ``result.json``, which it writes last once the final epoch is scored."""
    from tasks.finetune.train import RESULT, finetune_store
    from tasks.jobs.checkpoint import run_prefix

    store = finetune_store(job.config.store or settings.resolved_store_uri, settings)
    key = f"{run_prefix(job.config.run_name)}/{RESULT}"
    if not store.exists(key):
        raise LaunchError(f"fine-tuning run {job.config.run_name} ended without {RESULT}")
    return FinetuneJobResult.model_validate(json.loads(store.read_bytes(key)))  # json: NaN losses parse


def frozen_probe(job: Job, settings: Settings) -> FrozenProbe:
    """The L1 probe of the same checkpoint on the same splits (the transfer stage's features, cached in
    the store, read in the job's precision: bf16 features are about 3× fp32's on a CPU that has it), for
    the model card."""
    from tasks.transfer.config import TransferParams
    from tasks.transfer.probe import fit_probe
    from tasks.transfer.stage import extract, split_features

    params = TransferParams(
        checkpoint=job.config.checkpoint,
        datasets=[job.config.dataset],
        text_column=job.config.text_column,
        label_column=job.config.label_column,
        precision=job.config.precision,
    )
    extracted = extract(params, job.config.dataset, settings)
    data = split_features(extracted, settings)
    result = fit_probe(*data["train"], *data["dev"], *data["test"], Cs=params.Cs, solver=params.solver)
    return FrozenProbe(
        test_accuracy=float(result.test_accuracy),
        dev_accuracy=float(result.dev_accuracy),
        C=float(result.C),
        features_precision=extracted.features_precision,
    )


def baseline(job: Job, settings: Settings) -> BaselineReport:
    """The TF-IDF baseline on the same splits (cached in the store by the transfer stage)."""
    from tasks.transfer.config import TransferParams
    from tasks.transfer.stage import measure_baseline

    params = TransferParams(
        checkpoint=job.config.checkpoint,
        datasets=[job.config.dataset],
        text_column=job.config.text_column,
        label_column=job.config.label_column,
    )
    return measure_baseline(job.config.dataset, job.dataset_checksum, params, settings)


def model_card(report: FinetuneReport) -> str:
    """The registered version's description: fine-tuned beside the frozen probe and the baseline."""
    settings = report.settings
    lines = [
        f"Fine-tuned mLSTM (Kant et al. 2018): {settings['head']} head on {settings['pool']} pooling of the cell "
        f"states, trained with the mLSTM{' frozen' if settings['freeze_lm'] else ''} on {report.name} "
        f"(`{report.source}`), data checksum {report.checksum[:16]}, from checkpoint "
        f"`{report.checkpoint_uri}`.",
        "",
        "| model | test accuracy |",
        "|---|---:|",
        f"| fine-tuned (this version) | {report.test_accuracy:.2%} |",
    ]
    if probe := report.probe:
        read = probe.features_precision
        features = "" if read == "fp32" else f", features in {read}"
        lines.append(f"| frozen L1 probe, same checkpoint{features} | {probe.test_accuracy:.2%} |")
    if report.baseline:
        lines.append(f"| TF-IDF + logistic regression | {report.baseline.test_accuracy:.2%} |")
    lines += [
        "",
        f"- epoch {report.best_epoch} of {settings['epochs']} chosen on dev: accuracy {report.dev_accuracy:.2%} at "
        f"logit threshold {report.threshold:.3g} (folded into the head's bias)",
        f"- texts longer than {settings['max_bytes']} bytes are cut at the "
        f"{'front (their end is kept)' if settings['truncate'] == 'front' else 'back (their start is kept)'}",
        f"- auxiliary LM loss weight {settings['aux_lm_weight']:g}; slanted triangular lr, peak {settings['lr']:g}",
    ]
    return "\n".join(lines) + "\n"


def register_result(
    job: Job, result: FinetuneJobResult, settings: Settings, *, compare: bool = True
) -> FinetuneResult:
    """Log the run's classifier as a pyfunc, register it, and let the champion rule decide. ``compare``:
    measure the frozen probe and the TF-IDF baseline for the model card."""
    import mlflow

    from tasks.finetune.train import finetune_store, load_classifier
    from tasks.transfer.config import TransferParams
    from tasks.transfer.registry import lineage_of, log_classifier, register
    from tasks.transfer.stage import accuracy_on_test

    store = finetune_store(job.config.store or settings.resolved_store_uri, settings)
    classifier = load_classifier(store, result.classifier_key)
    source = load_dataset(
        job.config.dataset, text_column=job.config.text_column, label_column=job.config.label_column
    ).source
    report = FinetuneReport(
        name=result.dataset,
        source=source,
        checksum=result.checksum,
        checkpoint_uri=result.checkpoint_uri,
        test_accuracy=result.test_accuracy,
        dev_accuracy=result.dev_accuracy,
        best_epoch=result.best_epoch,
        threshold=result.threshold,
        settings=job.config.model_dump(include=set(weight_settings())),
        probe=frozen_probe(job, settings) if compare else None,
        baseline=baseline(job, settings) if compare else None,
    )
    run_id = str(result.run_id)
    with mlflow.start_run(run_id=run_id):
        metrics = {"test_accuracy": result.test_accuracy}
        if report.probe:
            metrics["probe_test_accuracy"] = report.probe.test_accuracy
        if report.baseline:
            metrics["baseline_test_accuracy"] = report.baseline.test_accuracy
        mlflow.log_metrics(metrics)
        mlflow.log_dict(report.model_dump(), "finetune/report.json")
    model_uri = log_classifier(run_id, classifier, f"classifier-{result.dataset}")
    params = TransferParams(
        checkpoint=job.config.checkpoint,
        datasets=[job.config.dataset],
        text_column=job.config.text_column,
        label_column=job.config.label_column,
    )
    lineage = {
        **lineage_of(result.checkpoint_run_id, settings),
        "method": "finetune",
        "finetune_run": job.config.run_name,
        "finetune_mlflow_run_id": run_id,
        "finetune_settings": json.dumps(report.settings, sort_keys=True),
    }
    registered = register(
        model_uri,
        report,
        settings,
        score_on_test=lambda uri: accuracy_on_test(uri, job.config.dataset, params),
        lineage=lineage,
        description=model_card(report),
    )
    return FinetuneResult(**result.model_dump(), report=report, registered=registered, model_uri=model_uri)
