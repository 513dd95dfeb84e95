"""The transfer stage's parameters: pydantic only (the dataset reader once a value is checked), so that the
CLI's help and the pipeline's parameters need neither numpy nor torch.

- ``ProbeSettings``: how an L1 probe is fitted (the sweep of C, the solver), declared once for every
  command that fits one: ``transfer``, ``probe`` and the fine-tuning stage's frozen probe.
- ``TransferParams``: the stage's parameters, the CLI's flags and the Prefect form.
- ``ProbeFilesParams``: the ``probe`` command's, on feature files already written.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.jobs.config import FEATURES_PRECISION, Precision
from tasks.settings import Flag
from tasks.transfer.solvers import DEFAULT_SOLVER, Solver


class ProbeSettings(BaseModel):
    """How an L1 probe is fitted: the values of C it sweeps on dev, and the solver."""

    model_config = ConfigDict(extra="forbid")

    # 2^-8 … 2^2: from a probe with no non-zero weight to one that overfits 4096 features on 25k reviews.
    c_min_log2: int = Field(default=-8, description="Smallest C of the sweep, as a power of 2.")
    c_max_log2: int = Field(default=2, description="Largest C of the sweep, as a power of 2.")
    solver: Solver = Field(
        default=DEFAULT_SOLVER,
        description="Probe solver: newton (proximal Newton; CPU threads or a GPU) or liblinear (the "
        "reference).",
    )
    seed: int = Field(default=0, description="Seed of the probe's solver.")

    @model_validator(mode="after")
    def _ascending(self) -> ProbeSettings:
        if self.c_min_log2 > self.c_max_log2:
            raise ValueError(f"c_min_log2 {self.c_min_log2} is above c_max_log2 {self.c_max_log2}")
        return self

    @property
    def Cs(self) -> tuple[float, ...]:
        return tuple(2.0**k for k in range(self.c_min_log2, self.c_max_log2 + 1))


class TransferInputs(BaseModel):
    """What the transfer stage reads: the checkpoint, the datasets, and how their features are made."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        description="Checkpoint URI: a step folder, a run folder or its latest.json; newest: the last saved."
    )
    datasets: Annotated[list[str], Flag("--dataset")] = Field(
        min_length=1,
        description="NAME=PATH, repeatable: SST (folder), IMDB (aclImdb folder, tarball or CSV), a "
        "CSV/JSONL table.",
    )
    text_column: str | None = Field(default=None, description="Text column of CSV/JSONL tables.")
    label_column: str | None = Field(default=None, description="Label column of CSV/JSONL tables.")
    batch_size: int | None = Field(
        default=None, ge=1, description="Texts per feature batch. [default: as many as fit memory]"
    )
    precision: Precision = Field(default="auto", description=FEATURES_PRECISION)

    @field_validator("datasets")
    @classmethod
    def _names_unique(cls, specs: list[str]) -> list[str]:
        from tasks.transfer.datasets import declared_name

        names = [declared_name(spec) for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names must differ, got {', '.join(names)}: write NAME=PATH")
        return specs


# Fields in the order of the bases from the last: the inputs, the probe, then the stage's own.
class TransferParams(ProbeSettings, TransferInputs):
    """The transfer stage's parameters: what the CLI's flags and the Prefect UI's form set."""

    register_dataset: Annotated[str | None, Flag("--register")] = Field(
        default=None,
        description="Dataset whose classifier is registered. [default: the first; none: none]",
    )
    baseline: bool = Field(
        default=True,
        description="Also measure the TF-IDF + logistic-regression baseline on the same splits (cached "
        "in the store by dataset), shown beside the probe.",
    )

    @model_validator(mode="after")
    def _registered_is_one_of_the_datasets(self) -> TransferParams:
        from tasks.transfer.datasets import declared_name

        names = [declared_name(spec) for spec in self.datasets]
        if (
            self.register_dataset
            and self.register_dataset.lower() != "none"
            and self.register_dataset not in names
        ):
            raise ValueError(
                f"--register {self.register_dataset!r} is not one of the datasets ({', '.join(names)})"
            )
        return self

    @property
    def registered_dataset(self) -> str | None:
        """The dataset whose classifier is registered, or None."""
        from tasks.transfer.datasets import declared_name

        if self.register_dataset and self.register_dataset.lower() == "none":
            return None
        return self.register_dataset or declared_name(self.datasets[0])


class FeatureFiles(BaseModel):
    """Feature files already written (by ``features``): the three splits and their columns."""

    model_config = ConfigDict(extra="forbid")

    train: str = Field(description="Arrow features of the train split (a path or s3:// URI).")
    dev: str = Field(description="Arrow features of the dev split: chooses C.")
    test: str = Field(description="Arrow features of the test split: scores the probe.")
    features_column: str = Field(default="features", description="The column of feature vectors.")
    label_column: str = Field(default="label", description="The column of 0/1 labels.")


class ProbeFilesParams(ProbeSettings, FeatureFiles):
    """The ``probe`` command's parameters: the feature files, then the probe's settings."""
