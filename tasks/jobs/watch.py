"""Following a launched job to its end from rank 0's log: its lines, its progress, and an error that
names what the ranks said last (the same for every launcher and every job)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tasks.jobs import joblog
from tasks.jobs.launchers.base import JobError, JobFailed, JobHandle, JobState, Launcher, LaunchError


class LogReader:
    """Rank 0's log of one job, read on from where the last read stopped."""

    def __init__(self, launcher: Launcher, handle: JobHandle) -> None:
        self.launcher, self.handle, self.offset = launcher, handle, 0

    def new_lines(self) -> list[str]:
        text, self.offset = self.launcher.logs(self.handle, self.offset)
        return text.splitlines()


def watch(
    launcher: Launcher,
    handle: JobHandle,
    *,
    on_line: Callable[[str], None],
    on_progress: Callable[[dict[str, float]], None],
    poll_seconds: float = 1.0,
    reader: LogReader | None = None,
) -> JobState:
    """Follow a job to its end, passing on each line of rank 0's log and each progress line. A failed
    job's error names what the ranks said last and where the whole log is. ``reader``: the caller's, to
    read the lines written after an interrupted watch (a cancelled job's last words)."""
    log = reader or LogReader(launcher, handle)
    errors: list[str] = []  # what the job said when it gave up (tasks/jobs/joblog.py)
    failures: list[str] = []
    where = f" (log: {handle.log_path})" if handle.log_path else ""

    def drain() -> None:
        lines = log.new_lines()
        for line in lines:
            on_line(line)
        errors.extend(joblog.errors_in(lines))
        failures.extend(joblog.failures_in(lines))
        for progress in joblog.iter_progress(lines):
            on_progress(progress)

    while True:
        status = launcher.status(handle)
        drain()
        if status.state.finished:
            drain()
            if status.state is JobState.FAILED and errors:
                raise JobError(f"job {handle.job_id} failed: {errors[-1]}{where}")
            if status.state is JobState.FAILED:
                said = f"; {failures[-1]}" if failures else ""
                raise JobFailed(f"job {handle.job_id} failed: {status.message}{said}{where}")
            if status.state is JobState.CANCELLED:
                raise LaunchError(f"job {handle.job_id} was cancelled")
            return status.state
        time.sleep(poll_seconds)
