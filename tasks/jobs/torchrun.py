"""``python -m tasks.jobs.torchrun ARGS`` is ``torchrun ARGS`` that cannot outlive the process that started it.

The local launcher starts torchrun in its own session, so that cancelling reaches every rank; the price
is that torchrun no longer dies with the flow process. When a worker SIGKILLs a flow run that has not
finished stopping its job within the worker's grace period, the kernel's parent-death signal
(Linux ``PR_SET_PDEATHSIG``) is what still stops torchrun, and, set again in each rank by
``tasks.pretrain.train``, the ranks when torchrun itself goes. Elsewhere than Linux it is plain torchrun.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "MLSTM_LAUNCHER_PID"


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits, however it exits.

    The signal is sent when the *thread* that started this process exits: the launcher starts a job
    from the thread that then watches it to its end, so that is the same moment. SIGTERM, not SIGKILL,
    so that ranks checkpoint first.
    """
    if sys.platform != "linux":
        return
    expected = os.getppid() if parent_pid is None else parent_pid
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not allowed here (a seccomp profile): torchrun's own handling remains
    if os.getppid() != expected:  # the parent died before the prctl could take effect
        os.kill(os.getpid(), sig)


def main() -> None:
    parent = os.environ.pop(PARENT_PID_ENV, None)
    die_with_parent(int(parent) if parent else None)
    sys.argv = ["torchrun", *sys.argv[1:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
