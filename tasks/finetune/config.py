"""The fine-tuning stage's settings, declared once (as tasks/pretrain/config.py declares pretraining's).

- ``FinetuneSettings``: how the job trains. Each field is a flag of ``mlstm-sentiment finetune``, a
  field of the pipeline's ``finetune.`` settings and of the Prefect form, and a flag of the job
  (``python -m tasks.finetune.train``). Those marked ``WEIGHTS`` change the trained weights: a resume
  refuses a change to one (a later one declares its neutral value: tasks/jobs/config.py's ``Weights``).
  Adam's settings besides the learning rate come from ``OptimizerSettings``, shared with pretraining.
- ``FinetuneParams``: the stage's parameters: the checkpoint, the dataset, the settings, the launch.
- ``FinetuneConfig``: what the job parses from its command line.

Only pydantic and the job runtime's config are imported: a command refuses a bad setting
without loading torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.jobs.config import (
    WEIGHTS,
    LaunchSettings,
    OptimizerSettings,
    Precision,
    checked_run_name,
    flag_errors,
    job_args,
    parse_job_args,
    weight_marks,
)

__all__ = ["FinetuneConfig", "FinetuneParams", "FinetuneSettings", "flag_errors", "weight_settings"]


class FinetuneSettings(OptimizerSettings):
    """How the job fine-tunes: the head, the data's shape, the optimiser and its schedule."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # fmt: off
    head: Annotated[Literal["linear", "mlp"], WEIGHTS] = Field(default="linear", description="The classifier head on the pooled states: linear or mlp.")
    # pool, lr and aux_lm_weight: the candidate best on dev among five (benchmarks/finetune_select.py,
    # test read once, for the one chosen; docs/finetune.md).
    pool: Annotated[Literal["last", "mean", "max", "concat"], WEIGHTS] = Field(default="max", description="Pooling of the cell states over the text: last (the probe's feature), mean, max or concat (all three).")
    mlp_hidden: Annotated[int, WEIGHTS] = Field(default=256, ge=1, description="Hidden units of the mlp head.")
    aux_lm_weight: Annotated[float, WEIGHTS] = Field(default=0.0, ge=0, description="Weight of the auxiliary next-byte loss (Kant et al. 2018); 0: none.")
    freeze_lm: Annotated[bool, WEIGHTS] = Field(default=False, description="Train the head only; the mLSTM's weights stay as the checkpoint has them.")
    epochs: Annotated[int, WEIGHTS] = Field(default=3, ge=1, description="Passes over the train split; the best on dev is kept.")
    batch_size: Annotated[int, WEIGHTS] = Field(default=32, ge=1, description="Global batch in texts, split across ranks.")
    max_bytes: Annotated[int, WEIGHTS] = Field(default=1024, ge=2, description="Longer texts are cut to this many bytes before reading.")
    truncate: Annotated[Literal["front", "back"], WEIGHTS] = Field(default="front", description="Which end of a long text is cut: front (keep its end) or back (keep its start).")
    # fastai's SortishSampler (ULMFiT, Howard & Ruder 2018): a batch steps as long as its longest text, so
    # random batches of SST sentences spend half their steps on padding, sorted groups a few per cent
    # (benchmarks/finetune.py measures both).
    sort_batches: Annotated[int, WEIGHTS] = Field(default=50, ge=1, description="Batches whose rows are ordered by length together (each epoch's shuffled rows cut into groups of this many batches, each group sorted, the batches then shuffled); 1: random batches.")
    # Howard & Ruder 2018: slanted triangular learning rates; their cut_frac 0.1 and ratio 32.
    lr: Annotated[float, WEIGHTS] = Field(default=3e-3, gt=0, description="Peak Adam learning rate of the slanted triangular schedule.")
    lr_cut_frac: Annotated[float, WEIGHTS] = Field(default=0.1, gt=0, lt=1, description="Fraction of the steps the learning rate rises.")
    lr_ratio: Annotated[float, WEIGHTS] = Field(default=32.0, ge=1, description="How much smaller the lowest learning rate is than the peak.")
    # Discriminative fine-tuning (Howard & Ruder 2018): the pretrained layers move slower than the new head.
    lm_lr_factor: Annotated[float, WEIGHTS] = Field(default=1.0, gt=0, le=1, description="The mLSTM's learning rate as a fraction of the head's, at every step of the schedule; 1: one rate for both.")
    clip: Annotated[float, WEIGHTS] = Field(default=1.0, gt=0, description="Gradient norm clip, on unscaled gradients.")
    seed: Annotated[int, WEIGHTS] = Field(default=0, description="Seed of the head's weights and the order of the rows.")
    precision: Annotated[Precision, WEIGHTS] = Field(default="auto", description="auto (bf16 or fp16 on GPUs, fp32 on CPU), bf16, fp16 or fp32.")
    checkpoint_every: int = Field(default=100, ge=1, description="Steps between checkpoints (and at each epoch's end).")
    log_every: int = Field(default=10, ge=1, description="Steps between progress lines.")
    max_steps: int | None = Field(default=None, ge=1, description="End this launch after this step; the same run resumes.")
    # fmt: on

    @model_validator(mode="after")
    def _aux_needs_the_lm(self) -> FinetuneSettings:
        if self.freeze_lm and self.aux_lm_weight:
            raise ValueError(
                f"--aux-lm-weight {self.aux_lm_weight:g} with --freeze-lm: a frozen language model cannot learn "
                "from its own loss; leave one out"
            )
        return self


def weight_settings() -> frozenset[str]:
    """The settings marked ``WEIGHTS``: what a resume compares, and the run's identity besides its data."""
    return frozenset(weight_marks(FinetuneSettings))


class FinetuneTarget(BaseModel):
    """What a launch fine-tunes, on what, and its run."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        description="Pretraining checkpoint URI (a step folder, a run folder, latest.json) or newest."
    )
    dataset: str = Field(
        description="NAME=PATH or PATH: SST, IMDB, or a CSV/JSON-lines table with text and label."
    )
    text_column: str | None = Field(default=None, description="Table data: the text column. [default: text]")
    label_column: str | None = Field(
        default=None, description="Table data: the label column. [default: label]"
    )
    run: str | None = Field(default=None, description="Run name; the same name resumes. [default: new]")
    baseline: bool = Field(
        default=True, description="Also measure the frozen probe and the TF-IDF baseline for the model card."
    )


class FinetuneParams(LaunchSettings, FinetuneSettings, FinetuneTarget):
    """The fine-tuning stage's parameters: the CLI's flags and the Prefect form."""

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node or self.nproc or 1


class FinetuneConfig(FinetuneSettings):
    """Everything a fine-tuning run computes from. The job's flags are these fields, with dashes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(description="The pretraining checkpoint's URI (resolved).")
    dataset: str = Field(description="NAME=PATH or PATH of the labelled data.")
    text_column: str | None = Field(default=None, description="Table data: the text column.")
    label_column: str | None = Field(default=None, description="Table data: the label column.")
    run_name: str = Field(
        description="Checkpoints go to <store>/finetune/runs/<run_name>/; the same name resumes."
    )
    store: str | None = Field(default=None, description="Store. Default: MLSTM_STORE_URI.")
    mlflow_run_id: str | None = Field(default=None, description="MLflow run to log into (rank 0).")
    tracking: Literal["mlflow", "off"] = Field(
        default="mlflow", description="mlflow: per-epoch metrics in MLflow; off: in the log only."
    )

    @field_validator("run_name")
    @classmethod
    def _run_is_a_key(cls, name: str) -> str:
        return checked_run_name(name)

    def to_args(self) -> list[str]:
        """The job's command-line flags for this config (defaults left out)."""
        return job_args(self)

    @classmethod
    def from_args(cls, argv: list[str]) -> FinetuneConfig:
        return parse_job_args(
            cls,
            argv,
            prog="python -m tasks.finetune.train",
            description="The fine-tuning job (one rank of it).",
        )
