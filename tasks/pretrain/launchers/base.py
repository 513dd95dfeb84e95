"""Launchers: one interface to start the training job on this machine, under Slurm or on Kubernetes.

``submit(spec) → handle``, then ``status``, ``logs`` and ``cancel`` on the handle. Every launcher runs
the same thing: ``torchrun … -m tasks.pretrain.train <flags>``, one torchrun per node. Only rank 0 of the job
writes progress, so "the job's log" is rank 0's log (plus any rank's traceback).
"""

from __future__ import annotations

import contextlib
import enum
import os
import shlex
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tasks.pretrain.torchrun import PARENT_PID_ENV

JOB_MODULE = "tasks.pretrain.train"


class LaunchError(RuntimeError):
    """A job could not be submitted, watched or cancelled; the message names the command that failed."""


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
    module: str = JOB_MODULE
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


class LocalLauncher(Launcher):
    """torchrun as a child process of this one: gloo on CPU, NCCL on GPUs (chosen by the job)."""

    name = "local"
    # torchrun forwards SIGTERM to the ranks, which checkpoint and exit; this long, then SIGKILL. Under
    # the 30 s a Prefect worker gives a cancelled flow run before it SIGKILLs it.
    grace_seconds = 20.0

    def __init__(self) -> None:
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._cancelled: set[str] = set()

    def command(self, spec: JobSpec) -> list[str]:
        if spec.nodes != 1:
            raise ValueError(
                f"the local launcher runs on this machine only: --nodes {spec.nodes} needs "
                "--launcher slurm or --launcher kubernetes"
            )
        torchrun = [sys.executable, "-m", "tasks.pretrain.torchrun", "--standalone"]
        return [*torchrun, "--nproc-per-node", str(spec.nproc_per_node), *spec.job_command()]

    def submit(self, spec: JobSpec) -> JobHandle:
        command = self.command(spec)
        spec.workdir.mkdir(parents=True, exist_ok=True)
        log_path = spec.workdir / f"{spec.name}.log"
        with log_path.open("ab") as log:
            log.write(f"$ {shlex.join(command)}\n".encode())
            log.flush()
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())},
                start_new_session=True,  # its own process group, so cancel reaches every rank
            )
        handle = JobHandle(self.name, str(process.pid), str(log_path))
        self._processes[handle.job_id] = process
        return handle

    def _process(self, handle: JobHandle) -> subprocess.Popen[bytes]:
        if handle.job_id not in self._processes:
            raise LaunchError(f"job {handle.job_id} was not started by this launcher")
        return self._processes[handle.job_id]

    def status(self, handle: JobHandle) -> JobStatus:
        code = self._process(handle).poll()
        if code is None:
            return JobStatus(JobState.RUNNING)
        if code == 0:
            return JobStatus(JobState.SUCCEEDED, 0)
        if (
            code in (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM)
            and handle.job_id in self._cancelled
        ):
            return JobStatus(JobState.CANCELLED, code, "cancelled")
        return JobStatus(JobState.FAILED, code, f"torchrun exited with {code}")

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        return read_log(handle.log_path, offset)

    def cancel(self, handle: JobHandle) -> None:
        process = self._process(handle)
        if process.poll() is not None:
            return
        self._cancelled.add(handle.job_id)
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(self.grace_seconds)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
        # Ranks that outlived torchrun (it was killed before it could reap them) go too.
        _signal_group(process.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


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
        ]  # <root>/tasks/pretrain/launchers/
    for folder in tried:
        if (folder / relative).is_file():
            return folder / relative
    looked = ", ".join(str(folder / relative) for folder in tried)
    raise LaunchError(
        f"infra/{relative} is missing: looked for {looked}; set MLSTM_INFRA_DIR to the checkout's "
        "infra/ folder, or run from the checkout"
    )


def launcher_for(name: str) -> Launcher:
    """The launcher of a name: ``local``, ``slurm`` or ``kubernetes``."""
    if name == "local":
        return LocalLauncher()
    if name == "slurm":
        from tasks.pretrain.launchers.slurm import SlurmLauncher

        return SlurmLauncher()
    if name == "kubernetes":
        from tasks.pretrain.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher()
    raise ValueError(f"unknown launcher {name!r}: choose local, slurm or kubernetes")
