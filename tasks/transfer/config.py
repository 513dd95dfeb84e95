"""The transfer stage's parameters: pydantic and the dataset names only, so that the CLI and the pipeline's
parameters check them without loading torch or scikit-learn."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.jobs.config import Precision
from tasks.transfer.datasets import declared_name
from tasks.transfer.solvers import Solver


class TransferParams(BaseModel):
    """The transfer stage's parameters: what the CLI's flags and the Prefect UI's form set."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(
        description="Checkpoint URI: a step folder, a run folder or its latest.json; newest: the last saved."
    )
    datasets: list[str] = Field(
        min_length=1, description="NAME=PATH, one per dataset: an SST or IMDB layout, or a CSV/JSONL table."
    )
    text_column: str | None = Field(default=None, description="Text column of CSV/JSONL tables.")
    label_column: str | None = Field(default=None, description="Label column of CSV/JSONL tables.")
    batch_size: int | None = Field(
        default=None, ge=1, description="Texts per feature batch; none: as many as fit the device's memory."
    )
    precision: Precision = Field(
        default="auto",
        description="The features' dtype: auto (bf16 or fp16 on GPUs, fp32 on CPU), bf16 (on CPUs with "
        "AVX-512 BF16 or AMX about 3x fp32's speed at 1,024 units and more, slower at 64), fp16 or fp32.",
    )
    c_min_log2: int = Field(default=-8, description="Smallest C of the sweep, as a power of 2.")
    c_max_log2: int = Field(default=2, description="Largest C of the sweep, as a power of 2.")
    register_dataset: str | None = Field(
        default=None,
        description="Dataset whose classifier is registered in MLflow. Default: the first; 'none': none.",
    )
    seed: int = Field(default=0, description="Seed of the probe's solver.")
    baseline: bool = Field(
        default=True,
        description="Also measure the TF-IDF + logistic-regression baseline on the same splits (cached "
        "in the store by dataset), shown beside the probe.",
    )
    solver: Solver = Field(
        # newton solves the same objective as liblinear, 5-10x faster over the sweep (docs/transfer.md).
        default="newton",
        description="Probe solver: newton (proximal Newton), liblinear (the reference) or torch (FISTA); "
        "newton and torch use CPU threads or a GPU.",
    )

    @field_validator("datasets")
    @classmethod
    def _names_unique(cls, specs: list[str]) -> list[str]:
        names = [declared_name(spec) for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names must differ, got {', '.join(names)}: write NAME=PATH")
        return specs

    @model_validator(mode="after")
    def _consistent(self) -> TransferParams:
        if self.c_min_log2 > self.c_max_log2:
            raise ValueError(f"c_min_log2 {self.c_min_log2} is above c_max_log2 {self.c_max_log2}")
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
    def Cs(self) -> tuple[float, ...]:
        return tuple(2.0**k for k in range(self.c_min_log2, self.c_max_log2 + 1))

    @property
    def registered_dataset(self) -> str | None:
        """The dataset whose classifier is registered, or None."""
        if self.register_dataset and self.register_dataset.lower() == "none":
            return None
        return self.register_dataset or declared_name(self.datasets[0])
