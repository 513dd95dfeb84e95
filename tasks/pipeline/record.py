"""A pipeline run's record: each stage's summary and record, the run's result, its lineage and metrics
(computed from the results, as values), and the MLflow parent run that keeps them.

A stage's record holds the wall seconds of its own part of the run, skip checks included: what a weekly
run spends stage by stage against a full one (``benchmarks/weekly.py``) is read from these.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from tasks.corpus.result import CorpusResult
from tasks.finetune.result import FinetuneResult
from tasks.pipeline import STAGES, PipelineParams, Stage
from tasks.pretrain.result import PretrainResult
from tasks.settings import Settings
from tasks.transfer.result import TransferResult


class StageSummary(BaseModel):
    """One stage of a pipeline run as its result shows it (``--json``, the Prefect table): its state,
    the key its inputs were found by, its MLflow run and Prefect flow run, and its wall seconds. A run
    read back from MLflow (a deployment's) knows no key, and no seconds when it ran before stages were
    timed; a skipped stage has no flow run: such fields are left out."""

    model_config = ConfigDict(frozen=True)

    state: str
    key: str | None = None
    run_id: str | None
    flow_run_id: str | None = None
    seconds: float | None = None

    @model_serializer(mode="wrap")
    def _known_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        optional = ("key", "flow_run_id", "seconds")
        return {k: v for k, v in shown.items() if v is not None or k not in optional}


# A stage's own result model (corpus, pretrain, transfer, finetune).
StageResult = TypeVar("StageResult")


@dataclass(frozen=True, kw_only=True)
class StageRecord(Generic[StageResult]):
    """What one stage of a pipeline run did: ran or skipped, the key its inputs were found by, its result
    (the stage's own model) and where it is recorded."""

    state: Literal["ran", "skipped"]
    key: str
    result: StageResult
    run_id: str | None  # the stage's MLflow run
    flow_run_id: str | None = None  # the stage's Prefect flow run, when it ran
    # Wall seconds of the stage's part of the pipeline run: its key, its skip check, its subflow.
    seconds: float | None = None

    def summary(self) -> StageSummary:
        """The stage as the pipeline's result shows it."""
        return StageSummary(
            state=self.state,
            key=self.key,
            run_id=self.run_id,
            flow_run_id=self.flow_run_id or None,
            seconds=self.seconds,
        )

    def lineage(self, stage: str) -> dict[str, str]:
        """The ids a registered model version carries back to this stage."""
        ids = {f"{stage}_run_id": self.run_id, f"{stage}_prefect_flow_run_id": self.flow_run_id}
        return {key: value for key, value in ids.items() if value}


class Incremental(BaseModel):
    """What an incremental run grew and continued from; one line per part that ran in full, and why."""

    model_config = ConfigDict(frozen=True)

    corpus: str | None = None  # the corpus id the delta grew (or found unchanged)
    delta_rows: int = 0
    found: bool = False  # the corpus stage found the corpus built (by an earlier run or corpus-refresh)
    checkpoint: str | None = None  # the champion's: continued from, or found trained on the corpus
    continued: bool = False
    full: tuple[str, ...] = ()


class PipelineResult(BaseModel):
    """A pipeline run: its MLflow parent run, each stage's summary and each result of a stage that ran
    or was found done. A run read back from MLflow (a deployment's) has the summaries only."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    stages: dict[str, StageSummary]
    corpus: CorpusResult | None = None
    pretrain: PretrainResult | None = None
    transfer: TransferResult | None = None
    finetune: FinetuneResult | None = None
    incremental: Incremental | None = None

    def shown(self) -> dict[str, Any]:
        """What ``pipeline --json`` prints: the stages, the corpus and training results, and the transfer's
        datasets and registered version (its reports stay in the store and MLflow)."""
        shown: dict[str, Any] = {
            "run_id": self.run_id,
            "stages": {s: i.model_dump() for s, i in self.stages.items()},
        }
        if self.corpus is not None:
            shown["corpus"] = self.corpus.model_dump()
        if self.pretrain is not None:
            shown["pretrain"] = self.pretrain.model_dump()
        if self.transfer is not None:
            shown["transfer"] = self.transfer.model_dump(include={"run_id", "datasets", "registered"})
        if self.incremental is not None:
            shown["incremental"] = self.incremental.model_dump()
        return shown


def ended_states(stages: list[Stage], records: dict[str, StageRecord[Any]]) -> dict[str, str]:
    """Each stage's state at the end of a run: its record's; for a run that failed, the first stage
    without one is the one that failed, and the later ones never started."""
    states = {stage: record.state for stage, record in records.items()}
    missing = [stage for stage in stages if stage not in records]
    return states | {stage: "failed" if i == 0 else "not started" for i, stage in enumerate(missing)}


def transfer_metrics(result: TransferResult) -> dict[str, float]:
    """The pipeline run's metrics from a transfer's result: each dataset's test accuracy, and its
    baseline's where it was measured."""
    metrics = {}
    for name, values in result.datasets.items():
        metrics[f"{name}_test_accuracy"] = values.test_accuracy
        if values.baseline_test_accuracy is not None:
            metrics[f"{name}_baseline_test_accuracy"] = values.baseline_test_accuracy
    return metrics


def pipeline_metrics(
    corpus: CorpusResult | None,
    pretrain: PretrainResult | None,
    transfer: TransferResult | None,
    finetune: FinetuneResult | None,
) -> dict[str, float]:
    """The pipeline run's metrics from the results its stages handed on (those that ended)."""
    metrics: dict[str, float] = {}
    if corpus is not None:
        metrics["corpus_rows"] = float(corpus.rows)
    if pretrain is not None:
        # A loss or bpc of 0 or None (nothing trained or validated) is no metric.
        metrics |= {
            k: float(v) for k, v in (("final_loss", pretrain.final_loss), ("val_bpc", pretrain.val_bpc)) if v
        }
    if transfer is not None:
        metrics |= transfer_metrics(transfer)
    if finetune is not None:
        metrics[f"{finetune.dataset}_finetune_test_accuracy"] = finetune.test_accuracy
    return metrics


def stage_seconds(records: dict[str, StageRecord[Any]]) -> dict[str, float]:
    """The pipeline run's metric ``STAGE_seconds`` for each stage that ended and was timed."""
    return {f"{stage}_seconds": r.seconds for stage, r in records.items() if r.seconds is not None}


def stage_lineage(records: dict[str, StageRecord[Any]]) -> dict[str, str]:
    """The ids a registered version carries back to each stage's MLflow run and Prefect flow run."""
    return {key: value for stage, record in records.items() for key, value in record.lineage(stage).items()}


def registered_lineage(transfer: TransferResult) -> dict[str, str]:
    """The registered version a transfer made, and the transfer's run, for the pipeline run's tags."""
    if transfer.registered is None:
        return {}
    return {
        "model_version": str(transfer.registered.version),
        "model_name": transfer.registered.name,
        "transfer_run_id": transfer.run_id,
    }


# --- The pipeline's record in MLflow: a parent run, one child run per stage that ran. ---------------

PARAMS_ARTIFACT = "pipeline_params.json"


# The pipeline's own ids are lineage for the model version, but on the pipeline run they repeat its
# run id and its ``prefect_flow_run_id`` tag.
_OWN_IDS = ("pipeline_run_id", "pipeline_prefect_flow_run_id")


def open_pipeline_run(settings: Settings, params: PipelineParams, tags: dict[str, str]) -> str:
    """The parent run of the stages' runs; its parameters are kept whole, so a rerun can start from them."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from tasks.tracking import connect

    experiment = connect(settings)  # an unreachable server fails here, before anything is logged
    client = MlflowClient()
    name = f"pipeline-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    run = client.create_run(experiment.experiment_id, run_name=name, tags={"stage": "pipeline", **tags})
    run_id = str(run.info.run_id)
    with mlflow.start_run(run_id=run_id):
        mlflow.log_dict(params.model_dump(mode="json"), PARAMS_ARTIFACT)
        mlflow.log_params(
            {
                "stages": ",".join(params.stages),
                "force": ",".join(params.force) or "-",
                "sources": _clipped(",".join(params.sources)) or "-",
                "preset": params.pretrain.preset,
                "launcher": params.pretrain.launcher,
                "datasets": ",".join(spec.partition("=")[0] for spec in params.transfer.datasets) or "-",
            }
        )
    return run_id


def _clipped(value: str, limit: int = 500) -> str:
    """An MLflow parameter short enough for any backend; the whole value is in the params artifact."""
    return value if len(value) <= limit else value[: limit - 1] + "…"


def close_pipeline_run(
    run_id: str,
    states: dict[str, str],
    lineage: dict[str, str],
    metrics: dict[str, float],
    *,
    failed: bool,
    note: str | None = None,
) -> None:
    """Stage states, lineage and metrics on the parent run; ``note`` is its description in the UI."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    for stage, state in states.items():
        client.set_tag(run_id, f"stage.{stage}", state)
    for key, value in lineage.items():
        if key not in _OWN_IDS:
            client.set_tag(run_id, key, value)
    if note:
        client.set_tag(run_id, "mlflow.note.content", note)
    for key, metric in metrics.items():
        client.log_metric(run_id, key, metric)
    client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")


def pipeline_params_of(run_id: str, settings: Settings) -> tuple[dict[str, Any], dict[str, str]]:
    """A past pipeline run's parameters and tags (its outputs: manifest_uri, checkpoint_uri, …)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tasks.tracking import connect

    connect(settings)
    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        raise ValueError(
            f"--from {run_id}: no such MLflow run at {settings.shown_mlflow_tracking_uri}"
        ) from error
    if run.data.tags.get("stage") != "pipeline":
        raise ValueError(
            f"--from {run_id}: that is a {run.data.tags.get('stage', 'non-pipeline')} run; give a pipeline "
            "run id (`mlstm-sentiment status`) or a manifest/checkpoint URI"
        )
    import mlflow

    params = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/{PARAMS_ARTIFACT}")
    return params, dict(run.data.tags)


def recent_pipelines(settings: Settings, limit: int) -> list[dict[str, Any]]:
    """The newest pipeline runs, as `mlstm-sentiment status` shows them."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking import experiment_id

    experiment = experiment_id(settings)  # connects first: a client made before would use the default URI
    runs = MlflowClient().search_runs(
        [experiment],
        "tags.stage = 'pipeline'",
        max_results=limit,
        order_by=["attributes.start_time DESC"],
    )
    return [
        {
            "run_id": run.info.run_id,
            "started": datetime.fromtimestamp(run.info.start_time / 1000, UTC).isoformat(timespec="seconds"),
            "status": run.info.status,
            "stages": {stage: run.data.tags.get(f"stage.{stage}", "-") for stage in STAGES},
            "metrics": dict(run.data.metrics),
            "vs_baseline": probe_vs_baseline(run.data.metrics),
            "model_version": run.data.tags.get("model_version"),
            "incremental": run.data.tags.get("incremental"),
            "prefect_flow_run_id": run.data.tags.get("prefect_flow_run_id"),
        }
        for run in runs
    ]


def probe_vs_baseline(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per dataset whose TF-IDF baseline was measured: the probe's and the baseline's test accuracy and
    the difference (probe − baseline), from a pipeline run's metrics."""
    found = {}
    for key, baseline in metrics.items():
        name = key.removesuffix("_baseline_test_accuracy")
        if name != key and f"{name}_test_accuracy" in metrics:
            probe = metrics[f"{name}_test_accuracy"]
            found[name] = {
                "test_accuracy": probe,
                "baseline_test_accuracy": baseline,
                "difference": probe - baseline,
            }
    return dict(sorted(found.items()))


def pipeline_result_of(flow_run_id: str, settings: Settings) -> PipelineResult:
    """What a pipeline flow run (a deployment's, on a worker) recorded in MLflow, as the CLI prints it."""
    from tasks.tracking import find_run

    run = find_run(settings, {"stage": "pipeline", "prefect_flow_run_id": flow_run_id})
    if run is None:
        raise ValueError(f"flow run {flow_run_id} left no finished pipeline run in MLflow")
    tags = run.data.tags
    metrics = run.data.metrics
    stages = {
        stage: StageSummary(
            state=tags[f"stage.{stage}"],
            run_id=tags.get(f"{stage}_run_id"),
            seconds=metrics.get(f"{stage}_seconds"),
        )
        for stage in STAGES
        if f"stage.{stage}" in tags
    }
    return PipelineResult(run_id=run.info.run_id, stages=stages)
