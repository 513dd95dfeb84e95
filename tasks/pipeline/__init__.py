"""The whole job as one: its parameters and what each stage's result depends on (its record, in MLflow,
is ``tasks/pipeline/record.py``'s).

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
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.corpus.config import CorpusConfig
from tasks.finetune.config import FinetuneParams
from tasks.jobs.config import run_identity
from tasks.pretrain.config import PretrainParams, run_key
from tasks.secrets import hide
from tasks.settings import Flag, Settings
from tasks.store import Store
from tasks.transfer.config import TransferParams

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
    # Half the rows: on val, 5% forgot the base where half kept it (docs/benchmarks.md, "A base that has
    # read its corpus"); four fifths did a little better still, but a pass over the delta then takes five
    # times the steps, past the weekly run's 15% of a full one.
    replay: float = Field(default=0.5, ge=0, lt=1, description="Incremental: pretraining's replay share.")
    continued_warmup: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="Incremental: the continued run's warm-up, a share of its steps "
        "(pretrain.warmup_steps is a run from scratch's, often longer than a week's delta).",
    )

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
