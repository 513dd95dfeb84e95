"""A stop for tasks that run on threads of the command's own process (a run of one piece).

Ctrl-C and SIGTERM raise in the main thread only, where the flow waits for its tasks, and a thread
pool's exit waits for the tasks still running: a task on a worker thread (``flows.runtime.runner_for``)
would finish its whole piece after the command was stopped. The flow waits inside
``stop_threads_on_error``, which sets ``STOPPING`` as the signal's exception leaves the wait, before the
pool's exit; such a task calls ``stop_if_told`` between batches and ends there, its piece not
published, so that a rerun scores it again. A pool's worker processes are stopped by the pool, as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

STOPPING = threading.Event()


class Stopped(Exception):
    """A task that ended because its flow stopped waiting for it: not worth retrying."""


def stop_if_told() -> None:
    """Raise ``Stopped`` once the flow has stopped waiting (``stop_threads_on_error``)."""
    if STOPPING.is_set():
        raise Stopped("the flow stopped (Ctrl-C, SIGTERM or a failed task): this piece was not finished")


@contextlib.contextmanager
def stop_threads_on_error() -> Iterator[None]:
    """Around a flow's wait for its tasks: any exception out of it (Ctrl-C, SIGTERM, a failed piece) tells
    the tasks on this process's threads to stop at their next ``stop_if_told``."""
    STOPPING.clear()
    try:
        yield
    except BaseException:
        STOPPING.set()
        raise
