"""Processes the project starts in a session of their own: stopping them, children included, and
making them die with the process that started them.

A process in its own session (torchrun, the temporary Prefect API) does not get the terminal's Ctrl-C
meant for the command, so the command stops it in order; the price is that it no longer dies with the
command's process group. When the command is killed outright (SIGKILL, a worker's grace period spent),
the kernel's parent-death signal (Linux ``PR_SET_PDEATHSIG``) is what still stops it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "MLSTM_LAUNCHER_PID"


def stop_group(process: subprocess.Popen[bytes], *, grace: float = 20.0) -> None:
    """SIGTERM the process group of ``process`` (started with ``start_new_session=True``); SIGKILL what
    is left of the group after ``grace`` seconds, children that outlived their leader included."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):  # the group outlives its leader while a member lives
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits, however it exits.

    The signal is sent when the *thread* that started this process exits: the launcher starts a job
    from the thread that then watches it to its end, so that is the same moment. SIGTERM, not SIGKILL,
    so that ranks checkpoint first. Elsewhere than Linux this does nothing.
    """
    if sys.platform != "linux":
        return
    expected = os.getppid() if parent_pid is None else parent_pid
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not allowed here (a seccomp profile)
    if os.getppid() != expected:  # the parent died before the prctl could take effect
        os.kill(os.getpid(), sig)


def parented(command: list[str]) -> tuple[list[str], dict[str, str]]:
    """``python -m MODULE ARGS`` as a command that dies with this process, and the environment it needs."""
    if command[1:2] != ["-m"]:
        raise ValueError(f"not a `python -m MODULE` command: {command[:3]}")
    return [command[0], "-m", __name__, *command[2:]], {PARENT_PID_ENV: str(os.getpid())}


def main() -> None:
    """``python -m tasks.processes MODULE ARGS``: ``python -m MODULE ARGS`` that dies with its parent."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    die_with_parent(int(parent) if parent else None)
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
