"""Where flows run: the Prefect API to talk to and the task runner that executes the pieces."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.corpus import cpu_count
from tasks.settings import Settings


class PrefectUnavailable(RuntimeError):
    """The configured Prefect API does not answer."""


@contextlib.contextmanager
def prefect_api(settings: Settings) -> Iterator[str]:
    """Use the configured Prefect API, or run a temporary local one for the length of the block.

    One temporary server is shared by this process and every worker process it starts (through
    PREFECT_API_URL), and it is drained and stopped cleanly at the end. Its runs are kept in
    Prefect's local database, so ``prefect server start`` shows them afterwards.
    """
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = settings.prefect_api_url or os.environ.get("PREFECT_API_URL")
    if url:
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=10).raise_for_status()
        except httpx.HTTPError as error:
            raise PrefectUnavailable(
                f"the Prefect API at {url} does not answer ({error}); start it with "
                "`prefect server start`, or fix MLSTM_PREFECT_API_URL / PREFECT_API_URL"
            ) from error
        with _environ("PREFECT_API_URL", url), temporary_settings({PREFECT_API_URL: url}):
            yield url
        return

    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    # Flow code that asks for "the" ephemeral server finds this one instead of starting another.
    previous = SubprocessASGIServer._instances.get(None)
    SubprocessASGIServer._instances[None] = server
    # The server writes to the stderr it inherits, including the tracebacks of requests cancelled
    # when it stops; they belong in a log file, not in the user's terminal.
    log = settings.home / "logs" / "prefect-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with _stderr_to(log):
        server.start()
    try:
        with (
            _environ("PREFECT_API_URL", server.api_url),
            temporary_settings({PREFECT_API_URL: server.api_url}),
        ):
            try:
                yield server.api_url
            finally:
                _drain_prefect_workers()
    finally:
        server.stop()
        if previous is not None:
            SubprocessASGIServer._instances[None] = previous
        else:
            SubprocessASGIServer._instances.pop(None, None)


def _drain_prefect_workers() -> None:
    """Flush logs and events to the API before it stops, so nothing errors at exit."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        with contextlib.suppress(RuntimeError):
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` for the block, so processes started in it inherit that."""
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def task_runner(settings: Settings) -> Any:
    """The Prefect task runner named by the settings; Dask and Ray need their Prefect integrations."""
    workers = settings.max_workers or cpu_count()
    if settings.task_runner == "process":
        from prefect.task_runners import ProcessPoolTaskRunner

        return ProcessPoolTaskRunner(max_workers=workers)
    if settings.task_runner == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    if settings.task_runner == "dask":
        try:
            from prefect_dask import DaskTaskRunner  # type: ignore[import-not-found]
        except ImportError as error:
            raise RuntimeError("MLSTM_TASK_RUNNER=dask needs `pip install prefect-dask`") from error
        if settings.task_runner_address:
            return DaskTaskRunner(address=settings.task_runner_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers})
    try:
        from prefect_ray import RayTaskRunner  # type: ignore[import-not-found]
    except ImportError as error:
        raise RuntimeError("MLSTM_TASK_RUNNER=ray needs `pip install prefect-ray`") from error
    return RayTaskRunner(address=settings.task_runner_address)
