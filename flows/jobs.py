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

from flows import progress
from flows.runtime import retry_unless
from tasks.jobs import joblog
from tasks.jobs.launchers.base import JobError, JobFailed, JobHandle, JobSpec, Launcher
from tasks.jobs.watch import LogReader, watch


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
    them too (a damaged checkpoint skipped, fp16 steps skipped), and its events (a resume, a checkpoint
    on SIGTERM) to whoever watches the flow (the CLI's terminal) as they happen."""
    if line.startswith(joblog.WARNING_PREFIX):
        logger.warning("%s", line.removeprefix(joblog.WARNING_PREFIX))
        return
    logger.info("%s", line)
    if joblog.is_event(line):
        progress.current().note(line)


def _relaunched_after(error: JobFailed) -> bool:
    """Whether the task's retry will relaunch the job after ``error``: a crash, with retries left. (Its
    last failure is the command's error line instead.)"""
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return (
        context is not None
        and not isinstance(error, JobError)
        and context.task_run.run_count <= context.task.retries
    )


def _relaunch_note(logger: Any, job_id: str) -> None:
    """Say so when this launch is a retry of the task: a relaunch after a crash, resuming."""
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    if context is None or context.task_run.run_count <= 1:
        return
    message = (
        f"relaunched job {job_id} (attempt {context.task_run.run_count} of {context.task.retries + 1}) "
        "after a crash: it resumes from its last checkpoint"
    )
    logger.info("%s", message)
    progress.current().note(message)


def launch_and_watch(
    launcher: Launcher, spec: JobSpec, on_progress: Callable[[dict[str, float]], None]
) -> None:
    """Submit a job and follow rank 0's log into the flow run's to the job's end; a job still running
    when this is interrupted (Ctrl-C, SIGTERM, a cancelled flow run) is cancelled: no process outlives
    it, and the step it checkpointed at is noted on the interruption for the CLI's last line."""
    logger = get_run_logger()
    handle: JobHandle | None = None
    reader: LogReader | None = None
    finished = False
    try:
        with terminate_raises():
            handle = launcher.submit(spec)
            reader = LogReader(launcher, handle)
            logger.info("submitted %s job %s (log: %s)", launcher.name, handle.job_id, handle.log_path or "-")
            _relaunch_note(logger, handle.job_id)
            on_line = functools.partial(_log_line, logger)
            try:
                watch(launcher, handle, on_line=on_line, on_progress=on_progress, reader=reader)
            except JobFailed as error:  # it has ended: there is nothing to stop
                finished = True
                if _relaunched_after(error):
                    progress.current().note(f"crashed: {error}")
                raise
            finished = True
    except BaseException as error:
        if handle is not None and reader is not None and not finished:
            _stop(launcher, handle, reader, logger, error, run=spec.name)
        raise


def _stop(
    launcher: Launcher, handle: JobHandle, reader: LogReader, logger: Any, error: BaseException, *, run: str
) -> None:
    """Cancel the job (its ranks checkpoint first) and say where it stopped, in the flow run's log and on
    ``error``, the interruption that the CLI turns into its last line."""
    logger.info("stopping %s job %s", launcher.name, handle.job_id)  # the CLI's last line says how it ended
    launcher.cancel(handle)
    lines = reader.new_lines()
    for line in lines:
        logger.info("%s", line)
    step = joblog.stopped_at(lines)
    said = f"run {run} checkpointed at step {step}" if step is not None else f"run {run}'s job stopped"
    error.add_note(said)
