"""Processes the test suite starts: stopped so they cannot outlive a test, and found if they did.

Every process started from the suite inherits ``SESSION_VARIABLE`` (tests/conftest.py sets it once per
session), so a leftover is found by its environment even after its parent died and it was reparented.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

SESSION_VARIABLE = "PYTEST_MLSTM_SESSION"


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


def started_by_session(token: str) -> list[str]:
    """``PID command line`` of every live process (not this one) whose environment holds the token."""
    marker = f"{SESSION_VARIABLE}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # a zombie's is empty: it is already gone
            if marker not in environ.split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile, or another user's
        found.append(f"{entry.name} {command.strip()}")
    return found
