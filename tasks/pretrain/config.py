"""The pretraining stage's settings, declared once.

- ``TrainSettings``: how the job trains. Each field is a flag of ``mlstm-sentiment pretrain`` (its options
  are generated from this model), a field of the pipeline's ``pretrain.`` settings and of the Prefect
  form, and a flag of the job itself (``python -m tasks.pretrain.train``).
- ``LaunchSettings``: where and how wide it runs, and how often it is retried: the flow's, not the job's.
- ``PretrainParams``: the stage's parameters, both of the above plus the corpus and the run's name.
- ``TrainConfig``: what the job parses from its command line, the training settings plus where the run
  lives and where it logs.

A setting marked ``WEIGHTS`` changes the weights a run trains: it is part of the run's identity, so
the pipeline's skip key is computed from these fields and a resume refuses a change to one. Adding a
setting is one line here (and its test); nothing else lists them. One that changes the weights, added
once runs exist, is marked ``Weights(neutral=...)`` with the value that trains as before it existed,
so that existing runs keep their keys and resume (tasks/jobs/config.py). Adam's settings besides the
learning rate come from ``OptimizerSettings``, shared with fine-tuning.

Only pydantic and ``models/config.py`` are imported, so that a command can refuse a bad setting
without loading torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from models.config import PRESETS, Recurrence, preset
from tasks.jobs.config import (
    WEIGHTS,
    LaunchSettings,
    OptimizerSettings,
    Precision,
    Sharding,
    Weights,
    checked_run_name,
    job_args,
    parse_job_args,
    run_identity,
    weight_marks,
)

LrScaling = Literal["none", "linear", "sqrt"]


class TrainSettings(OptimizerSettings):
    """How the job trains: the model, the data's shape, the optimiser and its schedule, how often it
    reports, and how a step runs."""

    # A learning rate of inf trains NaNs to the end and exits 0: numbers are finite here or refused.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # One line a setting.
    # fmt: off
    preset: Annotated[str, WEIGHTS] = Field(default="tiny", description=f"Model size: {', '.join(PRESETS)}.")
    # Puri et al.: 256 rows per GPU × 128 GPUs = 32k rows; Radford et al.: 128 rows on 4 GPUs.
    batch_size: Annotated[int, WEIGHTS] = Field(default=128, ge=1, description="Global batch in rows, split across ranks.")
    seq_len: Annotated[int, WEIGHTS] = Field(default=256, ge=1, description="Truncated BPTT length in bytes.")
    lr: Annotated[float, WEIGHTS] = Field(default=5e-4, gt=0, description="Adam learning rate at --lr-base-batch rows.")
    lr_base_batch: Annotated[int, WEIGHTS] = Field(default=128, ge=1, description="The batch size --lr is given for.")
    lr_scaling: Annotated[LrScaling, WEIGHTS] = Field(default="none", description="How lr follows the batch: none, linear or sqrt.")
    warmup_steps: Annotated[int, WEIGHTS] = Field(default=0, ge=0, description="Linear warm-up steps before the decay.")
    # A schedule whose length the data sets (a continued run's: one pass over the delta) has no fixed step count to warm up over.
    warmup_share: Annotated[float | None, Weights(neutral=None)] = Field(default=None, gt=0, lt=1, description="Warm-up as a share of the schedule's steps, in place of --warmup-steps (a continued run's schedule is as long as its new data).")
    total_steps: Annotated[int | None, WEIGHTS] = Field(default=None, ge=1, description="Schedule length. [default: one epoch of train]")
    # A budget for one launch, not the schedule: raising it resumes the same run.
    max_steps: int | None = Field(default=None, ge=1, description="End this launch after this step.")
    precision: Annotated[Precision, WEIGHTS] = Field(default="auto", description="auto (bf16 or fp16 on GPUs, fp32 on CPU), bf16, fp16 or fp32.")
    clip: Annotated[float, WEIGHTS] = Field(default=1.0, gt=0, description="Gradient norm clip, on unscaled gradients.")
    seed: Annotated[int, WEIGHTS] = Field(default=0, description="Seed of the initial weights.")
    # A continued run (docs/pretrain.md): the parent's weights stand in for the seed's; its own schedule.
    init_from: Annotated[str | None, Weights(neutral=None)] = Field(default=None, description="Start from these weights, with a schedule of its own: a checkpoint URI, a run's name, or champion (the checkpoint behind the registered champion).")
    init_optimizer: Annotated[bool, Weights(neutral=False)] = Field(default=False, description="With --init-from: take the parent's Adam moments too, not only its weights.")
    replay: Annotated[float, Weights(neutral=0.0)] = Field(default=0.0, ge=0, lt=1, description="With --init-from: the share of the batch's rows read from the parent's corpus; the rest read the corpus's new shards.")
    # How the state is spread over ranks, not what it is: a resume may change it.
    sharding: Sharding = Field(default="none", description="none (DDP), optimizer (ZeRO-1) or full (FSDP2, ZeRO-3).")
    checkpoint_every: int = Field(default=1000, ge=1, description="Steps between checkpoints.")
    val_every: int = Field(default=1000, ge=1, description="Steps between validations.")
    val_steps: int = Field(default=16, ge=1, description="Steps of the val split per validation.")
    log_every: int = Field(default=10, ge=1, description="Steps between progress lines.")
    # How a step runs, not what it computes (the same losses to rounding): free to change on a resume.
    recurrence: Recurrence = Field(default="fused", description="fused, or reference (the cell step by step: debugging).")
    compile: Literal["auto", "off"] = Field(default="auto", description="auto (gate math through torch.compile on CUDA) or off.")
    cuda_graph: Literal["auto", "off"] = Field(default="auto", description="auto (one CUDA graph per step on one GPU) or off.")
    # fmt: on

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str) -> str:
        preset(name)  # raises with the list of names
        return name

    def warmup(self, total_steps: int) -> int:
        """The warm-up in steps of a schedule of ``total_steps``: --warmup-share of it, or --warmup-steps."""
        if self.warmup_share is not None:
            return max(1, round(self.warmup_share * total_steps))
        return self.warmup_steps

    @model_validator(mode="after")
    def _one_warmup(self) -> TrainSettings:
        if self.warmup_share is not None and self.warmup_steps:
            raise ValueError("give --warmup-steps or --warmup-share, not both")
        return self

    @model_validator(mode="after")
    def _continuing(self) -> TrainSettings:
        if self.init_from is None:
            for name, flag in (("replay", self.replay), ("init_optimizer", self.init_optimizer)):
                if flag:
                    raise ValueError(
                        f"--{name.replace('_', '-')} continues a run: it needs --init-from (a checkpoint, a "
                        "run's name or champion)"
                    )
        return self


class RunTarget(BaseModel):
    """What a launch trains on, and the run it trains."""

    model_config = ConfigDict(extra="forbid")

    corpus: str = Field(
        description="URI of the corpus manifest.json (printed by `corpus build`); newest: the last built."
    )
    run: str | None = Field(default=None, description="Run name; the same name resumes. [default: new]")


# Fields in the order of the bases from the last: the corpus and run, the training, the launch (the
# order of the Prefect form and of `pretrain --help`).
class PretrainParams(LaunchSettings, TrainSettings, RunTarget):
    """The pretraining stage's parameters: what the CLI's flags and the Prefect UI's form set."""

    @property
    def nproc_per_node(self) -> int:
        if self.gpus_per_node and self.nproc and self.nproc != self.gpus_per_node:
            raise ValueError(
                f"--nproc {self.nproc} with --gpus-per-node {self.gpus_per_node}: one process runs per "
                "GPU, give only --gpus-per-node"
            )
        return self.gpus_per_node or self.nproc or 1


def run_key(settings: TrainSettings, corpus_id: str, parent_digest: str | None = None) -> str:
    """What a training run's weights depend on, as a key: the corpus and the settings marked ``WEIGHTS``
    (a later one only once it differs from its neutral value, so older runs keep their keys). A continued
    run's parent counts by its checkpoint's digest (``parent_digest``), not by the name it was given
    (``champion`` moves; a run's name or a URI may name the same weights)."""
    identity = run_identity(settings)
    if parent_digest is not None:
        identity["init_from"] = parent_digest
    values = {"corpus_id": corpus_id, **identity}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def weight_settings() -> frozenset[str]:
    """The settings marked ``WEIGHTS``: a run's identity besides its corpus."""
    return frozenset(weight_marks(TrainSettings))


class TrainConfig(TrainSettings):
    """Everything a training run computes from. The job's flags are these fields, with dashes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: str = Field(description="URI of the corpus manifest.json.")
    # Not --run: torchrun would take it for an abbreviation of its own --run-path.
    run_name: str = Field(description="Checkpoints go to <store>/runs/<run_name>/; the same name resumes.")
    store: str | None = Field(default=None, description="Store for checkpoints. Default: MLSTM_STORE_URI.")
    mlflow_run_id: str | None = Field(default=None, description="MLflow run to log into (rank 0).")
    tracking: Literal["mlflow", "off"] = Field(
        default="mlflow",
        description="mlflow: params, metrics and checkpoints in MLflow (rank 0); off: in the log only, "
        "for a node without MLflow.",
    )

    @field_validator("run_name")
    @classmethod
    def _run_is_a_key(cls, name: str) -> str:
        return checked_run_name(name)

    def run_settings(self) -> dict[str, Any]:
        """What a resume compares with the checkpoint's config: the corpus and the settings of the
        weights. The schedule's length is compared once resolved (its default is one epoch of the corpus)."""
        return self.model_dump(include={"corpus", *weight_marks(type(self))} - {"total_steps"})

    def effective_lr(self) -> float:
        ratio = self.batch_size / self.lr_base_batch
        return self.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]

    def to_args(self) -> list[str]:
        """The job's command-line flags for this config (defaults left out)."""
        return job_args(self)

    @classmethod
    def from_args(cls, argv: list[str]) -> TrainConfig:
        return parse_job_args(
            cls,
            argv,
            prog="python -m tasks.pretrain.train",
            description="The pretraining job (one rank of it).",
        )
