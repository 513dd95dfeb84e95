"""The transfer flow: features of each dataset → L1 probes → MLflow → the registered classifier.

Features are cached in the store by weights and data, so a rerun (another C range, another seed)
skips straight to the probes. Tasks pass store URIs and small reports, never features.
"""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from flows import names, progress
from tasks.settings import get_settings
from tasks.tracking import artifact_link, model_link, run_link
from tasks.transfer import registry
from tasks.transfer.datasets import dataset_name
from tasks.transfer.result import Extracted, ProbeReport, Registration, TransferResult
from tasks.transfer.stage import (
    TransferParams,
    accuracy_on_test,
    checkpoints_loaded_once,
    classifier_of,
    extract,
    probe,
)


@task(name="features", cache_policy=NO_CACHE)
def features_task(params: TransferParams, spec: str) -> Extracted:
    """One dataset's features (train, dev, test), from the cache or the model."""
    logger = get_run_logger()
    sink = progress.current()
    extracted = extract(
        params,
        spec,
        get_settings(),
        on_start=lambda rows: sink.stage(f"features {dataset_name(spec)}", total=rows),
        on_batch=lambda rows, _bytes: sink.advance(rows),
    )
    for split, info in extracted.splits.items():
        state = "cached" if info.cached else "computed"
        logger.info("%s %s: %d rows, %s: %s", extracted.name, split, info.rows, state, info.uri)
    return extracted


@task(name="probe", cache_policy=NO_CACHE)
def probe_task(extracted: Extracted, params: TransferParams, run_id: str) -> ProbeReport:
    """The C sweep, the refit, the sentiment neuron and the plots, recorded under the MLflow run."""
    logger = get_run_logger()
    settings = get_settings()
    sink = progress.current()
    sink.stage(f"probe {extracted.name}", total=len(params.Cs))

    def on_fit(point: Any) -> None:
        sink.advance(1)
        logger.info("%s %s", extracted.name, point)

    report = probe(extracted, params, settings, on_fit=on_fit)
    registry.log_report(run_id, report, settings)
    return report


@flow(name="register", flow_run_name=names.register_name)
def register(
    report: ProbeReport, params: TransferParams, run_id: str, lineage: dict[str, str] | None = None
) -> Registration:
    """Log the classifier as a pyfunc, register it with its lineage, and promote it if it beats the
    champion on the same test set."""
    settings = get_settings()
    model_uri = registry.log_classifier(run_id, classifier_of(report, settings), f"classifier-{report.name}")
    outcome = registry.register(
        model_uri,
        report,
        settings,
        score_on_test=lambda uri: accuracy_on_test(uri, report.spec, params),
        lineage={
            **(lineage or {}),
            "transfer_run_id": run_id,
            "register_prefect_flow_run_id": _flow_run_id(),
        },
        description=registry.model_card(report),
    )
    get_run_logger().info("registered %s v%s: %s", outcome.name, outcome.version, outcome.reason)
    create_markdown_artifact(
        key="registered-model",
        markdown=f"# Registered {model_link(settings, outcome.name, outcome.version)}\n\n{outcome.reason}.\n\n"
        f"Champion: `{outcome.champion_uri}`\n",
        description="The model version this run registered",
    )
    return outcome


def _flow_run_id() -> str:
    flow_run = get_run_context().flow_run  # type: ignore[union-attr]
    return str(flow_run.id) if flow_run else ""


@flow(name="transfer", flow_run_name=names.transfer_name)
def transfer(
    params: TransferParams, parent_run_id: str | None = None, lineage: dict[str, str] | None = None
) -> TransferResult:
    """Probe a checkpoint's features on labelled datasets; register the classifier in MLflow.

    Args:
        params: The checkpoint, the datasets and the probe's settings.
        parent_run_id: MLflow run (a pipeline's) to file this run under. Default: the run that
            trained the checkpoint.
        lineage: Tags for the registered version beyond what the checkpoint's run records.
    """
    # Each dataset's features and the registry read the one checkpoint (a pipeline's run, one scope).
    with checkpoints_loaded_once():
        return _probe_and_register(params, parent_run_id, lineage)


def _probe_and_register(
    params: TransferParams, parent_run_id: str | None, lineage: dict[str, str] | None
) -> TransferResult:
    settings = get_settings()
    extracted = [features_task(params, spec) for spec in params.datasets]
    checkpoint_run_id = extracted[0].checkpoint_run_id
    lineage = {**registry.lineage_of(checkpoint_run_id, settings), **(lineage or {})}
    run_id = registry.open_transfer_run(
        parent_run_id or checkpoint_run_id,
        settings,
        run_name=f"transfer-{extracted[0].weights}",
        tags={
            "stage": "transfer",
            "checkpoint_uri": extracted[0].checkpoint_uri,
            "prefect_flow_run_id": _flow_run_id(),
            **{k: v for k, v in lineage.items() if k in ("pretrain_run_id", "corpus_id", "manifest_uri")},
        },
    )
    try:
        reports = [probe_task(e, params, run_id) for e in extracted]
        wanted = params.registered_dataset
        registered = (
            register(next(r for r in reports if r.name == wanted), params, run_id, lineage)
            if wanted
            else None
        )
    except BaseException:
        MlflowClient().set_terminated(run_id, status="FAILED")
        raise
    MlflowClient().set_terminated(run_id)
    result = TransferResult.of(run_id, reports, registered)
    create_table_artifact(
        key="probe-report",
        table=[{"dataset": name, **values.model_dump()} for name, values in result.datasets.items()],
        description="L1 logistic-regression probes on the mLSTM's final cell state",
    )
    experiment = MlflowClient().get_run(run_id).info.experiment_id
    create_markdown_artifact(
        key="transfer-result",
        markdown=f"# Transfer of `{extracted[0].checkpoint_uri}`\n\n"
        f"{registry.report_markdown(reports, registered)}"
        f"{registry.heatmaps_markdown(reports, lambda path: artifact_link(settings, experiment, run_id, path))}\n"
        f"MLflow run: {run_link(settings, experiment, run_id)}\n"
        + (
            f"\nModel version: {model_link(settings, registered.name, registered.version)}\n"
            if registered
            else ""
        ),
        description="The probes beside the papers' numbers, the sentiment neuron's heatmaps, the classifier",
    )
    return result
