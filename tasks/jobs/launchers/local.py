"""The local launcher: torchrun as a child process of this one, on this machine."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from tasks.jobs.launchers.base import (
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LaunchError,
    read_log,
)
from tasks.jobs.torchrun import PARENT_PID_ENV
from tasks.processes import stop_group

LOOPBACK = "127.0.0.1"


class LocalLauncher(Launcher):
    """torchrun as a child process of this one: gloo on CPU, NCCL on GPUs (chosen by the job)."""

    name = "local"
    # torchrun forwards SIGTERM to the ranks, which checkpoint and exit; this long, then SIGKILL. Under
    # the 30 s a Prefect worker gives a cancelled flow run before it SIGKILLs it.
    grace_seconds = 20.0

    def __init__(self) -> None:
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._rendezvous: dict[str, Path] = {}
        self._cancelled: set[str] = set()

    def command(self, spec: JobSpec, rendezvous: Path) -> list[str]:
        """torchrun with its rendezvous in the file ``rendezvous`` (one per launch, removed after it).

        Not ``--standalone``: its rendezvous stores are TCPStores, and a TCPStore server listens on every
        interface whatever host it is given (torch 2.13, libuv and legacy alike). A file store opens no
        socket; the workers' own store is hosted by rank 0 on ``--local-addr`` (``tasks.jobs.world``).
        """
        if spec.nodes != 1:
            raise ValueError(
                f"the local launcher runs on this machine only: --nodes {spec.nodes} needs "
                "--launcher slurm or --launcher kubernetes"
            )
        torchrun = [sys.executable, "-m", "tasks.jobs.torchrun", *loopback_rendezvous(rendezvous)]
        return [*torchrun, "--nproc-per-node", str(spec.nproc_per_node), *spec.job_command()]

    def submit(self, spec: JobSpec) -> JobHandle:
        spec.workdir.mkdir(parents=True, exist_ok=True)
        clear_stale_rendezvous(spec.workdir)
        # The launching process's id in the name: a file whose launcher is gone is stale.
        rendezvous = spec.workdir / f"{spec.name}-{os.getpid()}-{uuid.uuid4().hex}.rendezvous"
        command = self.command(spec, rendezvous)
        log_path = spec.workdir / f"{spec.name}.log"
        with log_path.open("ab") as log:
            log.write(f"$ {shlex.join(command)}\n".encode())
            log.flush()
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={
                    **os.environ,
                    **spec.env,
                    **loopback_env(),
                    "PYTHONUNBUFFERED": "1",
                    PARENT_PID_ENV: str(os.getpid()),
                },
                start_new_session=True,  # its own process group, so cancel reaches every rank
            )
        handle = JobHandle(self.name, str(process.pid), str(log_path))
        self._processes[handle.job_id] = process
        self._rendezvous[handle.job_id] = rendezvous
        return handle

    def _process(self, handle: JobHandle) -> subprocess.Popen[bytes]:
        if handle.job_id not in self._processes:
            raise LaunchError(f"job {handle.job_id} was not started by this launcher")
        return self._processes[handle.job_id]

    def status(self, handle: JobHandle) -> JobStatus:
        code = self._process(handle).poll()
        if code is None:
            return JobStatus(JobState.RUNNING)
        self._rendezvous[handle.job_id].unlink(missing_ok=True)
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
        # SIGTERM (ranks checkpoint), then SIGKILL after the grace, to ranks that outlived torchrun too.
        stop_group(process, grace=self.grace_seconds)
        self._rendezvous[handle.job_id].unlink(missing_ok=True)


def clear_stale_rendezvous(workdir: Path) -> list[Path]:
    """Remove the rendezvous files in ``workdir`` whose launching process is gone (a CLI killed with
    SIGKILL never removes its own); a live launcher's file is kept. Returns what was removed."""
    removed = []
    for path in workdir.glob("*.rendezvous"):
        parts = path.stem.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue  # not named by this launcher
        try:
            os.kill(int(parts[1]), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:  # alive, another user's
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def loopback_rendezvous(rendezvous: Path) -> list[str]:
    """torchrun's flags for one node whose rendezvous is the file ``rendezvous`` (see ``command``)."""
    flags = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-conf", "store_type=file"]
    return [
        *flags,
        "--rdzv-endpoint",
        str(rendezvous),
        "--rdzv-id",
        rendezvous.stem,
        "--local-addr",
        LOOPBACK,
    ]


def loopback_env() -> dict[str, str]:
    """The environment that keeps a one-machine job's sockets on loopback.

    Without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` torchrun's agent would host the workers' store itself,
    as a TCPStore on every interface; with it, rank 0 hosts it (``tasks.jobs.world.World.from_env``
    binds it to ``MASTER_ADDR``, the ``--local-addr``). gloo's and NCCL's own listening sockets take
    the address of the interface named here, not of the host name's (which may be any interface).
    """
    interface = "lo0" if sys.platform == "darwin" else "lo"
    return {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "GLOO_SOCKET_IFNAME": interface,
        "NCCL_SOCKET_IFNAME": interface,
    }
