"""Running a torchrun job from a flow, for every stage that launches one (pretraining, fine-tuning):
submit it, follow rank 0's log into the flow run's, relaunch after a crash but not after an error the
job reported, hold the GPUs' concurrency slot, and cancel the job when the flow run is interrupted."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import TerminationSignal

from flows.runtime import retry_unless
from tasks.jobs import joblog
from tasks.jobs.launchers.base import JobError, JobFailed, JobHandle, JobSpec, Launcher
from tasks.jobs.watch import watch


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Turn SIGTERM into Prefect's TerminationSignal, so the ``finally`` that cancels the job runs, and a
    cancelled deployment run (the worker's SIGTERM) ends Cancelled, not Crashed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise TerminationSignal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def gpu_slot(limit: str) -> Iterator[None]:
    """Hold a slot of the global concurrency limit ``limit`` (made by `mlstm-sentiment deploy`), so two
    pretraining jobs never share the GPUs, whichever deployment or user started them. Without the
    limit (the embedded API of a laptop run) nothing is held."""
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(limit)
        except ObjectNotFound:
            get_run_logger().info(
                "no concurrency limit %r on this Prefect server: not waiting for one", limit
            )
            yield
            return
    get_run_logger().info("waiting for a slot of concurrency limit %r", limit)
    with concurrency(limit, occupy=1, strict=True):
        yield


# A crash (a killed rank, a lost node) is relaunched; an error the job reported itself is not.
worth_relaunching = retry_unless(JobError)


def _log_line(logger: Any, line: str) -> None:
    """A line of the job's log into the flow run's: its warnings as warnings, so that the terminal shows
    them too (a damaged checkpoint skipped, fp16 steps skipped)."""
    if line.startswith(joblog.WARNING_PREFIX):
        logger.warning("%s", line.removeprefix(joblog.WARNING_PREFIX))
    else:
        logger.info("%s", line)


def launch_and_watch(
    launcher: Launcher, spec: JobSpec, on_progress: Callable[[dict[str, float]], None]
) -> None:
    """Submit a job and follow rank 0's log into the flow run's to the job's end; a job still running
    when this is interrupted (SIGTERM, a cancelled flow run) is cancelled: no process outlives it."""
    logger = get_run_logger()
    handle: JobHandle | None = None
    finished = False
    try:
        with terminate_raises():
            handle = launcher.submit(spec)
            logger.info("submitted %s job %s (log: %s)", launcher.name, handle.job_id, handle.log_path or "-")
            try:
                watch(launcher, handle, on_line=functools.partial(_log_line, logger), on_progress=on_progress)
            except JobFailed:  # it has ended: there is nothing to stop
                finished = True
                raise
            finished = True
    finally:
        if handle is not None and not finished:
            logger.warning("stopping %s job %s", launcher.name, handle.job_id)
            launcher.cancel(handle)
