"""Settings in one place: defaults that work with no setup, environment variables for production.

Every field can be set as ``MLSTM_<FIELD>`` (for example ``MLSTM_STORE_URI=s3://bucket/prefix``).
Reading the settings has no side effects: no folder is created and no tracking URI is set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

TaskRunnerName = Literal["process", "thread", "dask", "ray"]


@dataclass(frozen=True)
class Flag:
    """How a parameter is spelt on the command line where its field's name with dashes is not the flag
    (``Annotated[list[str], Flag("--dataset")]``: one NAME=PATH a use), or where the flag takes it as
    text (``text`` writes the default so; the model then parses that text)."""

    name: str | None = None
    text: Callable[[Any], str] | None = None


def flag_of(name: str, info: FieldInfo) -> Flag:
    """The field's ``Flag``, its name filled in: ``--batch-size`` for ``batch_size`` unless it says."""
    flag = next((mark for mark in info.metadata if isinstance(mark, Flag)), Flag())
    return Flag(flag.name or f"--{name.replace('_', '-')}", flag.text)


class WorkerOptions(BaseModel):
    """How a command that spreads its work over processes runs it (``corpus build``, ``score``): for one
    run, each overrides its setting below (``MLSTM_MAX_WORKERS``, ``MLSTM_TASK_RUNNER``)."""

    model_config = ConfigDict(extra="forbid")

    workers: int | None = Field(default=None, ge=1, description="Parallel workers. [default: CPU count]")
    task_runner: TaskRunnerName | None = Field(
        default=None, description="process, thread, dask or ray. [env: MLSTM_TASK_RUNNER]"
    )


class Settings(BaseSettings):
    """Where things live and how stages run."""

    model_config = SettingsConfigDict(env_prefix="MLSTM_", extra="ignore")

    home: Path = Field(
        default=Path(".mlstm-sentiment"),
        description="Folder for everything local by default: the store, MLflow's database, caches.",
    )
    store_uri: str | None = Field(
        default=None,
        description="Object store: a folder, file://path or s3://bucket/prefix. Default: <home>/store.",
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        description="S3-compatible endpoint (MinIO, Ceph, moto). Default: boto3's own resolution, "
        "which honours AWS_ENDPOINT_URL.",
    )
    s3_max_attempts: int = Field(default=10, ge=1, description="botocore retry attempts per call.")
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking server. Default: MLflow's own MLFLOW_TRACKING_URI, else "
        "sqlite:///<home>/mlflow.db.",
    )
    mlflow_registry_uri: str | None = Field(
        default=None,
        description="MLflow model registry. Default: MLflow's own MLFLOW_REGISTRY_URI, else the "
        "tracking URI.",
    )
    mlflow_experiment: str = Field(default="mlstm-sentiment", description="MLflow experiment name.")
    model_name: str = Field(
        default="mlstm-sentiment", description="Registered model name of the sentiment classifier."
    )
    prefect_api_url: str | None = Field(
        default=None,
        description="Prefect API (http://host:4200/api). Default: PREFECT_API_URL, else a "
        "temporary local server for the length of the command.",
    )
    pretrain_concurrency_limit: str = Field(
        default="pretrain-gpus",
        description="Prefect global concurrency limit a pretraining job holds a slot of, when it exists.",
    )
    sweep_storage_uri: str | None = Field(
        default=None,
        description="Optuna's database for sweeps (postgresql://… in the team install). "
        "Default: sqlite:///<home>/optuna.db, beside MLflow's.",
    )
    sweep_lease_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long a sweep worker's hold on a trial lasts unrenewed; after it, another "
        "worker takes the trial over (a dead worker on the same host is seen at once).",
    )
    task_runner: TaskRunnerName = Field(
        default="process", description="How a flow runs its pieces: process, thread, dask or ray."
    )
    task_runner_address: str | None = Field(
        default=None, description="Dask scheduler or Ray cluster address for task_runner dask/ray."
    )
    max_workers: int | None = Field(
        default=None, ge=1, description="Parallel pieces on this machine. Default: the CPU count."
    )
    score_memory_mib: int = Field(
        default=1024,
        ge=1,
        description="Memory (MiB) the feature batches of a `score` run's workers take together on CPUs: "
        "each of N workers sizes its batches to 1/N of it, whatever the input's size (on a GPU, half its "
        "free memory, shared by the workers on it). The process, the model and a window of rows come "
        "on top.",
    )
    checkpoint_key: SecretStr | None = Field(
        default=None,
        description="Key of the HMAC-SHA256 every checkpoint and registered classifier is signed with and "
        "every one read must carry: one changed in the store, or saved under another key or none, is "
        "refused. Default: a key made on first use in <home>/keys/checkpoint.key (mode 0600).",
    )
    max_text_chars: int = Field(
        default=20_000,
        ge=1,
        description="Longest text (characters) a classifier logged now will score, served or by `predict`; "
        "stored with the model. Longer texts are refused, not cut.",
    )

    @field_validator(
        "store_uri",
        "mlflow_tracking_uri",
        "mlflow_registry_uri",
        "prefect_api_url",
        "s3_endpoint_url",
        "sweep_storage_uri",
    )
    @classmethod
    def _blank_is_unset(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("home")
    @classmethod
    def _home_is_a_folder(cls, home: Path) -> Path:
        # Checked before anything is made in it: else the first folder made there fails, naming neither.
        if home.exists() and not home.is_dir():
            raise ValueError(f"MLSTM_HOME {home} is a file: give a folder (it is made if missing)")
        return home

    @cached_property
    def resolved_store_uri(self) -> str:
        return self.store_uri or str(self.home / "store")

    @cached_property
    def mlflow_tracking_uri_source(self) -> tuple[str, str]:
        """The tracking URI in force and the setting it came from: ours, MLflow's own variable (the
        one `mlflow ui` and every MLflow client read), else the local SQLite file."""
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri, "MLSTM_MLFLOW_TRACKING_URI"
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI"
        return f"sqlite:///{(self.home / 'mlflow.db').resolve()}", "default"

    @cached_property
    def resolved_mlflow_tracking_uri(self) -> str:
        return self.mlflow_tracking_uri_source[0]

    @cached_property
    def mlflow_registry_uri_source(self) -> tuple[str, str]:
        """The registry URI in force and its source, read the same way; MLflow's default is the
        tracking URI."""
        if self.mlflow_registry_uri:
            return self.mlflow_registry_uri, "MLSTM_MLFLOW_REGISTRY_URI"
        if os.environ.get("MLFLOW_REGISTRY_URI"):
            return os.environ["MLFLOW_REGISTRY_URI"], "MLFLOW_REGISTRY_URI"
        return self.resolved_mlflow_tracking_uri, f"tracking URI ({self.mlflow_tracking_uri_source[1]})"

    @cached_property
    def resolved_mlflow_registry_uri(self) -> str:
        return self.mlflow_registry_uri_source[0]

    @cached_property
    def shown_mlflow_tracking_uri(self) -> str:
        """The tracking URI as printed, logged and linked: a password in it (Postgres, a server behind
        basic auth) stays in the environment."""
        from tasks.secrets import redact

        return redact(self.resolved_mlflow_tracking_uri)


HOME_SPACE_MIB = 32  # what the temporary Prefect API's and MLflow's databases need to start and log a run


def check_home_space(folder: Path, setting: str = "MLSTM_HOME") -> None:
    """Refuse, in one line naming ``setting``, a home whose disk has less than ``HOME_SPACE_MIB`` free: a
    full disk otherwise shows as a server that does not start within its timeout."""
    import shutil

    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < HOME_SPACE_MIB << 20:
        raise ValueError(
            f"{setting} {folder}: no space left on device ({free / 2**20:.1f} MiB free; the temporary "
            f"Prefect API and MLflow's database need {HOME_SPACE_MIB} MiB): free some, or set {setting} "
            "to a folder on another disk"
        )


def get_settings(**overrides: object) -> Settings:
    """Read the settings from the environment, with explicit overrides (CLI flags) on top."""
    values: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**values)
