"""Stopping a process the project started in a session of its own, children included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


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
