"""The local launcher: torchrun as a child process of this one, on this machine."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys

from tasks.pretrain.launchers.base import (
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LaunchError,
    read_log,
)
from tasks.pretrain.torchrun import PARENT_PID_ENV


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
