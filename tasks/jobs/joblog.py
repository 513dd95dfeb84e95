"""The lines of rank 0's log that the launching side reads: how the job and its watcher talk.

The job (``tasks/pretrain/train.py``) writes them; the flow's watcher (``tasks/pretrain/stage.py``) reads
them from whichever launcher's log, without importing the job or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

ERROR_PREFIX = "error: "  # why the job gave up for good: the watcher fails the job with it, unretried
FAILURE_PREFIX = "failed: "  # an exception a relaunch may not meet again (a lost rank, the network)
WARNING_PREFIX = "warning: "  # something the user should see: the watcher logs it as a warning
PROGRESS_PREFIX = "progress "


def progress_line(values: dict[str, float]) -> str:
    """``progress step=10 of=100 loss=…``: one line of training progress."""
    return PROGRESS_PREFIX + " ".join(f"{key}={value:.6g}" for key, value in values.items())


def iter_progress(lines: Iterable[str]) -> Iterator[dict[str, float]]:
    """The progress lines of a job's log, as dicts (for the flow's progress display)."""
    for line in lines:
        if line.startswith(PROGRESS_PREFIX):
            yield {k: float(v) for k, _, v in (part.partition("=") for part in line.split()[1:])}


def errors_in(lines: Iterable[str]) -> list[str]:
    """What the job said when it gave up, from its error lines."""
    return [line.removeprefix(ERROR_PREFIX) for line in lines if line.startswith(ERROR_PREFIX)]


def failure_line(rank: int, error: BaseException) -> str:
    """``failed: rank 1: ConnectionError: …``: a rank's last exception, in one line."""
    message = " ".join(str(error).split())
    return f"{FAILURE_PREFIX}rank {rank}: {type(error).__name__}: {message}"


def failures_in(lines: Iterable[str]) -> list[str]:
    """The ranks' last exceptions, from their failure lines."""
    return [line.removeprefix(FAILURE_PREFIX) for line in lines if line.startswith(FAILURE_PREFIX)]
