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
# Events the user sees on the terminal as they happen, not only in the job's log.
RESUMED_PREFIX = "resumed run "
STOPPED_PREFIX = "SIGTERM: checkpointed at step "


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


def resumed_line(run: str, step: int, uri: str, seconds: float) -> str:
    """``resumed run NAME from step N (URI) in S s``: a launch that found a checkpoint and went on from it."""
    return f"{RESUMED_PREFIX}{run} from step {step} ({uri}) in {seconds:.2f} s"


def stopped_line(step: int) -> str:
    """What the job says when SIGTERM stopped it after writing a checkpoint."""
    return f"{STOPPED_PREFIX}{step}; launch again with the same run name to resume"


def is_event(line: str) -> bool:
    """Whether a line is one of the job's events (a resume, a checkpoint on SIGTERM)."""
    return line.startswith((RESUMED_PREFIX, STOPPED_PREFIX))


def stopped_at(lines: Iterable[str]) -> int | None:
    """The step the job checkpointed at when SIGTERM stopped it, from its lines; None if it did not say."""
    steps = [
        line.removeprefix(STOPPED_PREFIX).partition(";")[0]
        for line in lines
        if line.startswith(STOPPED_PREFIX)
    ]
    return int(steps[-1]) if steps else None
