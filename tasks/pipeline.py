"""The whole job as one: its parameters, what each stage's result depends on, and its record in MLflow.

The parameters import light (pydantic and the stages' own parameter models): the CLI checks them, and
reads the pipeline's record, without loading torch; the work each key needs is imported where it starts.

A stage is skipped when a finished result for the same inputs exists, found by a key computed from
content, never from dates: the corpus by its ``corpus_id`` (sources' checksums and settings), the
training run by the corpus and every setting that changes the weights, the transfer by the weights'
sha256, the datasets' checksums and the probe's settings. ``force`` runs a stage anyway.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tasks.corpus.config import CorpusConfig
from tasks.corpus.result import CorpusResult
from tasks.finetune.config import FinetuneParams
from tasks.finetune.result import FinetuneResult
from tasks.jobs.config import run_identity
from tasks.pretrain.config import PretrainParams, run_key
from tasks.pretrain.result import PretrainResult
from tasks.secrets import hide
from tasks.settings import Flag, Settings
from tasks.store import Store
from tasks.transfer.config import TransferParams
from tasks.transfer.result import TransferResult

Stage = Literal["corpus", "pretrain", "transfer", "finetune"]
STAGES: tuple[Stage, ...] = ("corpus", "pretrain", "transfer", "finetune")
# Fine-tuning trains the whole model (minutes to hours beyond the probe): a run asks for it (--finetune).
DEFAULT_STAGES: tuple[Stage, ...] = ("corpus", "pretrain", "transfer")
TRANSFER_KEY_IGNORES = {"checkpoint", "datasets", "batch_size"}


class PretrainStage(PretrainParams):
    """The pretraining stage inside the pipeline: the corpus comes from the corpus stage."""

    corpus: str = Field(default="", description="Filled in by the pipeline from the corpus stage.")


class TransferStage(TransferParams):
    """The transfer stage inside the pipeline: the checkpoint comes from the pretraining stage."""

    checkpoint: str = Field(default="", description="Filled in by the pipeline from the pretraining stage.")
    datasets: Annotated[list[str], Flag("--dataset")] = Field(
        default_factory=list,
        description="NAME=PATH, one per dataset: an SST or IMDB layout, or a CSV/JSONL table.",
    )


class FinetuneStage(FinetuneParams):
    """The fine-tuning stage inside the pipeline: the checkpoint comes from the pretraining stage, the
    dataset from the transfer stage's first unless given."""

    checkpoint: str = Field(default="", description="Filled in by the pipeline from the pretraining stage.")
    dataset: str = Field(default="", description="NAME=PATH. [default: the transfer stage's first dataset]")


class PipelineParams(BaseModel):
    """The pipeline's parameters: the Prefect UI's form for a run of the `pipeline` deployment."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str] = Field(
        default_factory=list, description="Raw reviews: files, folders, globs, s3:// or http(s):// URLs."
    )
    corpus: CorpusConfig = Field(default_factory=CorpusConfig, description="How the corpus is built.")
    pretrain: PretrainStage = Field(default_factory=PretrainStage, description="How the mLSTM is trained.")
    transfer: TransferStage = Field(default_factory=TransferStage, description="What the probes read.")
    finetune: FinetuneStage = Field(
        default_factory=FinetuneStage, description="How the classifier is fine-tuned (stage finetune)."
    )
    stages: list[Stage] = Field(
        default_factory=lambda: list(DEFAULT_STAGES),
        description="Stages to run, in pipeline order (finetune only when named).",
    )
    force: list[Stage] = Field(
        default_factory=list, description="Stages to run even when their inputs have not changed."
    )
    manifest_uri: str | None = Field(
        default=None, description="The corpus to train on when the corpus stage does not run."
    )
    checkpoint_uri: str | None = Field(
        default=None, description="The checkpoint to probe when the pretraining stage does not run."
    )
    from_sweep: str | None = Field(
        default=None,
        description="A sweep id: its best trial's checkpoint is the one probed and registered "
        "(the pretraining stage does not run).",
    )
    incremental: bool = Field(default=False, description="Grow the newest corpus, continue the champion.")
    replay: float = Field(default=0.05, ge=0, lt=1, description="Incremental: pretraining's replay share.")

    @field_validator("sources")
    @classmethod
    def _hide_credentials(cls, sources: list[str]) -> list[str]:
        """A source URL's credentials never reach the run's parameters, records or names."""
        return [hide(source) for source in sources]

    @model_validator(mode="after")
    def _inputs_are_known(self) -> PipelineParams:
        if not self.stages:
            raise ValueError("stages: name at least one of corpus, pretrain, transfer, finetune")
        self.stages = [stage for stage in STAGES if stage in self.stages]  # pipeline order, no repeats
        if "corpus" in self.stages and not self.sources:
            raise ValueError("sources: the corpus stage needs raw review files or URLs")
        if "pretrain" in self.stages and "corpus" not in self.stages and not self.manifest_uri:
            raise ValueError("manifest_uri: pretraining without the corpus stage needs a corpus manifest")
        if self.from_sweep:
            if "pretrain" in self.stages:
                raise ValueError("from_sweep: the sweep's best trial is the pretraining; leave pretrain out")
            if self.checkpoint_uri:
                raise ValueError("from_sweep: give a sweep or a checkpoint_uri, not both")
        if "transfer" in self.stages:
            if "pretrain" not in self.stages and not (self.checkpoint_uri or self.from_sweep):
                raise ValueError("checkpoint_uri: transfer without the pretraining stage needs a checkpoint")
            if not self.transfer.datasets:
                raise ValueError("transfer.datasets: the transfer stage needs at least one NAME=PATH")
        if "finetune" in self.stages:
            if "pretrain" not in self.stages and not (self.checkpoint_uri or self.from_sweep):
                raise ValueError(
                    "checkpoint_uri: fine-tuning without the pretraining stage needs a checkpoint"
                )
            if not (self.finetune.dataset or self.transfer.datasets):
                raise ValueError(
                    "finetune.dataset: the finetune stage needs a NAME=PATH (or transfer.datasets)"
                )
        return self


def digest(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def pretrain_params(stage: PretrainStage, manifest_uri: str) -> PretrainParams:
    return PretrainParams.model_validate({**stage.model_dump(), "corpus": manifest_uri})


def finetune_params(params: PipelineParams, checkpoint_uri: str) -> FinetuneParams:
    """The fine-tuning stage's parameters: the pipeline's checkpoint, the transfer's first dataset
    unless one is named."""
    dataset = params.finetune.dataset or params.transfer.datasets[0]
    return FinetuneParams.model_validate(
        {**params.finetune.model_dump(), "checkpoint": checkpoint_uri, "dataset": dataset}
    )


def finetune_key(params: FinetuneParams, settings: Settings) -> str:
    """What a fine-tuning's result depends on: the weights, the dataset's content, the settings of the
    weights (``WEIGHTS``; a later one only once it differs from its neutral value) and its run."""
    from tasks.transfer.datasets import load_dataset
    from tasks.transfer.features import weights_fingerprint
    from tasks.transfer.stage import load_checkpoint_of

    model = load_checkpoint_of(params.checkpoint, settings).model()
    data = load_dataset(params.dataset, text_column=params.text_column, label_column=params.label_column)
    return digest(
        {
            "weights": weights_fingerprint(model),
            "dataset": data.checksum,
            **run_identity(params),
            **params.model_dump(include={"run", "baseline"}),
        }
    )


def finetune_record_key(key: str) -> str:
    return f"pipeline/finetune/{key}.json"


def transfer_params(stage: TransferStage, checkpoint_uri: str) -> TransferParams:
    return TransferParams.model_validate({**stage.model_dump(), "checkpoint": checkpoint_uri})


def pretrain_key(params: PretrainParams, corpus_id: str, parent_digest: str | None = None) -> str:
    """What a training run's weights depend on: the corpus and the settings marked as changing them
    (tasks/pretrain/config.py), a later one only once it differs from its neutral value, so that the runs
    trained before it keep their keys; where, how wide and how often it reports leave the key as it is.
    A continued run's parent counts by its checkpoint's digest (``tasks.pretrain.config.run_key``)."""
    return run_key(params, corpus_id, parent_digest)


def pretrain_run_name(
    params: PretrainParams, corpus_id: str, *, force: bool, parent: str | None = None
) -> str:
    """The user's run name, else one derived from the key (the same inputs find the same run, which
    resumes or is already done); a forced run gets a fresh name and trains from scratch."""
    if params.run:
        return params.run
    name = f"{params.preset}-{corpus_id[:8]}-{pretrain_key(params, corpus_id, parent)[:8]}"
    return f"{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}" if force else name


def finished_run(store: Store, run: str, max_steps: int | None) -> dict[str, Any] | None:
    """The run's ``latest.json`` when it has reached the end of its schedule, or ``max_steps``: nothing
    left to train. (The run's name comes from its key, so its schedule is the one asked for.)"""
    from tasks.jobs.checkpoint import read_latest

    latest = read_latest(store, run)
    if latest is None:
        return None
    stop = min(latest["total_steps"], max_steps or latest["total_steps"])
    return latest if latest["step"] >= stop else None


class StageSummary(BaseModel):
    """One stage of a pipeline run as its result shows it (``--json``, the Prefect table): its state,
    the key its inputs were found by, its MLflow run and Prefect flow run. A run read back from MLflow
    (a deployment's) knows no key; a skipped stage has no flow run: such fields are left out."""

    model_config = ConfigDict(frozen=True)

    state: str
    key: str | None = None
    run_id: str | None
    flow_run_id: str | None = None

    @model_serializer(mode="wrap")
    def _known_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        return {k: v for k, v in shown.items() if v is not None or k not in ("key", "flow_run_id")}


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

    def summary(self) -> StageSummary:
        """The stage as the pipeline's result shows it."""
        return StageSummary(
            state=self.state, key=self.key, run_id=self.run_id, flow_run_id=self.flow_run_id or None
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


def transfer_key(params: TransferParams, settings: Settings) -> str:
    """What a transfer's result depends on: the weights, the datasets' content and the probe's settings."""
    from tasks.transfer.datasets import load_dataset
    from tasks.transfer.features import weights_fingerprint
    from tasks.transfer.stage import load_checkpoint_of

    model = load_checkpoint_of(params.checkpoint, settings).model()
    checksums = {
        spec: load_dataset(spec, text_column=params.text_column, label_column=params.label_column).checksum
        for spec in params.datasets
    }
    names = {spec.partition("=")[0]: checksum for spec, checksum in checksums.items()}
    return digest(
        {
            "weights": weights_fingerprint(model),
            "datasets": names,
            **transfer_key_settings(params),
        }
    )


def transfer_key_settings(params: TransferParams) -> dict[str, Any]:
    """The transfer's settings that its result depends on. The features' precision is one only where it
    is not auto, so that the keys of transfers run before it was a setting still match."""
    ignored = TRANSFER_KEY_IGNORES | ({"precision"} if params.precision == "auto" else set())
    return params.model_dump(exclude=ignored)


def transfer_record_key(key: str) -> str:
    return f"pipeline/transfer/{key}.json"


def apply_overrides(params: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """``--set key=value`` on a parameters dict: dotted keys reach into stages (``pretrain.lr=1e-3``);
    values are JSON where they parse (numbers, lists, null), else strings; a list field takes a
    comma-separated value too (``transfer.datasets=sst2=data/sst,imdb=data/imdb.csv``)."""
    result = json.loads(json.dumps(params))
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {assignment!r}: write key=value, e.g. pretrain.max_steps=500")
        *path, field = key.strip().split(".")
        target = result
        for part in path:
            if not isinstance(target.get(part), dict):
                raise ValueError(f"--set {key}: {part!r} is not a group of settings")
            target = target[part]
        if field not in target:
            known = ", ".join(sorted(target))
            raise ValueError(f"--set {key}: unknown setting {field!r}; known here: {known}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(target[field], list) and not isinstance(value, list):
            value = [part for part in str(raw).split(",") if part]
        target[field] = value
    return result


def validated(values: dict[str, Any]) -> PipelineParams:
    """PipelineParams from a dict, with errors in ``--set`` words (``pretrain.lr: …``)."""
    try:
        return PipelineParams.model_validate(values)
    except ValidationError as error:
        messages = []
        for item in error.errors():
            where = ".".join(str(part) for part in item["loc"])
            messages.append(f"{where}: {item['msg']}".replace("Value error, ", "").lstrip(": "))
        raise ValueError("; ".join(messages)) from None


def stages_from(stage: Stage, *, rest: bool) -> list[Stage]:
    """A rerun's stages: ``stage`` alone, or it and the default stages after it (finetune when named)."""
    order = STAGES if stage == "finetune" else DEFAULT_STAGES
    return list(order[order.index(stage) :]) if rest else [stage]


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
    stages = {
        stage: StageSummary(state=tags[f"stage.{stage}"], run_id=tags.get(f"{stage}_run_id"))
        for stage in STAGES
        if f"stage.{stage}" in tags
    }
    return PipelineResult(run_id=run.info.run_id, stages=stages)
