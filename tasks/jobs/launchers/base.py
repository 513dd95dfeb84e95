"""The launchers' one interface: start a torchrun job on this machine, under Slurm or on Kubernetes.

``submit(spec) → handle``, then ``status``, ``logs`` and ``cancel`` on the handle. Every launcher runs
the same thing: ``torchrun … -m <the spec's module> <flags>``, one torchrun per node (pretraining's
``tasks.pretrain.train``, fine-tuning's ``tasks.finetune.train``). Only rank 0 of the job
writes progress, so "the job's log" is rank 0's log (plus any rank's traceback).
"""

from __future__ import annotations

import enum
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


class LaunchError(RuntimeError):
    """A job could not be submitted, watched or cancelled; the message names the command that failed."""


class JobFailed(LaunchError):
    """The job has ended, failed: nothing is left to stop. Relaunched, as a crash may not happen again."""


class JobError(JobFailed):
    """The job stopped on an error it reported itself (an ``error: …`` line of rank 0's log: bad settings,
    a damaged checkpoint, a shard that fails its checksum). A relaunch would meet it again: not retried."""

    retryable = False


class JobState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What to run and on how much: ``nodes`` × ``nproc_per_node`` ranks of ``python -m module args``."""

    name: str
    args: tuple[str, ...]
    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    # The job's entry point (``python -m module``): the stage's, never guessed.
    module: str
    # Variables every rank needs (store endpoint, MLflow URI). Credentials never go into a rendered
    # file: Slurm passes the submitting environment on, Kubernetes reads them from a Secret.
    env: Mapping[str, str] = field(default_factory=dict)
    # Where the launcher keeps what it renders and the job's log (local and Slurm: a shared folder).
    workdir: Path = Path(".")

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise ValueError(
                f"a job needs at least one node and one process per node, got --nodes {self.nodes} "
                f"and {self.nproc_per_node} processes per node"
            )
        if self.gpus_per_node and self.nproc_per_node != self.gpus_per_node:
            raise ValueError(
                f"one process per GPU: --gpus-per-node {self.gpus_per_node} with {self.nproc_per_node} "
                "processes per node"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def job_command(self) -> list[str]:
        """What torchrun runs on every rank, after its own flags."""
        return ["-m", self.module, *self.args]


@dataclass(frozen=True)
class JobStatus:
    state: JobState
    exit_code: int | None = None
    message: str = ""


@dataclass(frozen=True)
class JobHandle:
    """Enough to find a submitted job again, also from another process: plain strings only."""

    launcher: str
    job_id: str
    log_path: str = ""


class Launcher(ABC):
    name: str

    @abstractmethod
    def submit(self, spec: JobSpec) -> JobHandle: ...

    @abstractmethod
    def status(self, handle: JobHandle) -> JobStatus: ...

    @abstractmethod
    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """Rank 0's log from byte ``offset`` on, and the offset to ask for next time."""

    @abstractmethod
    def cancel(self, handle: JobHandle) -> None:
        """Stop the job and every process it started; a no-op when it has ended."""

    def wait(
        self, handle: JobHandle, *, poll_seconds: float = 1.0, timeout: float | None = None
    ) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (status := self.status(handle)).state.finished:
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"job {handle.job_id} did not finish within {timeout} s")
            time.sleep(poll_seconds)
        return status


def read_log(path: str | Path, offset: int) -> tuple[str, int]:
    """New text of a growing log file, decoded leniently; only whole lines, so none is cut in two."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            chunk = log.read()
    except FileNotFoundError:
        return "", offset
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].decode("utf-8", "replace"), offset + end


def infra_file(relative: str) -> Path:
    """A file of the checkout's ``infra/`` (a launcher's template): in ``$MLSTM_INFRA_DIR`` when it is
    set, else beside this package's source (a checkout, an editable install) or in ``./infra`` (a
    non-editable install run from the checkout)."""
    if os.environ.get("MLSTM_INFRA_DIR"):
        tried = [Path(os.environ["MLSTM_INFRA_DIR"])]
    else:
        tried = [
            Path(__file__).resolve().parents[3] / "infra",
            Path.cwd() / "infra",
        ]  # <root>/tasks/jobs/launchers/
    for folder in tried:
        if (folder / relative).is_file():
            return folder / relative
    looked = ", ".join(str(folder / relative) for folder in tried)
    raise LaunchError(
        f"infra/{relative} is missing: looked for {looked}; set MLSTM_INFRA_DIR to the checkout's "
        "infra/ folder, or run from the checkout"
    )
