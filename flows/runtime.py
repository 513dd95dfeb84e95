"""Where flows run: the Prefect API to talk to and the task runner that executes the pieces."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tasks.corpus.build import cpu_count
from tasks.settings import Settings, check_home_space
from tasks.store import LocalStore, Store, StoreError


class PrefectUnavailable(RuntimeError):
    """The configured Prefect API does not answer."""


class ClusterUnavailable(RuntimeError):
    """The Dask scheduler named by the settings does not answer."""


def configured_api_url(settings: Settings) -> str | None:
    """The Prefect API the user configured (MLSTM_PREFECT_API_URL, else PREFECT_API_URL); None when
    flows are to run against a temporary local one."""
    return settings.prefect_api_url or os.environ.get("PREFECT_API_URL")


@contextlib.contextmanager
def prefect_api(settings: Settings) -> Iterator[str]:
    """Use the configured Prefect API, or run a temporary local one for the length of the block.

    One temporary server is shared by this process and every worker process it starts (through
    PREFECT_API_URL), and it is drained and stopped cleanly at the end. Its runs are kept in
    Prefect's local database (``$MLSTM_HOME/prefect`` unless the user has a PREFECT_HOME), so
    ``prefect server start`` with that PREFECT_HOME shows them afterwards.
    """
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = configured_api_url(settings)
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

    check_home_space(settings.home)  # its database is there (PREFECT_HOME, unless the user's own)
    server = _server_of_its_own()
    # Flow code that asks for "the" ephemeral server finds this one instead of starting another.
    previous = SubprocessASGIServer._instances.get(None)
    SubprocessASGIServer._instances[None] = server
    # The server writes to the stderr it inherits, including the tracebacks of requests cancelled
    # when it stops; they belong in a log file, not in the user's terminal.
    log = settings.home / "logs" / "prefect-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    timeout = _startup_timeout()
    try:
        with _stderr_to(log):
            server.start(timeout=timeout)
    except BaseException as error:
        server.stop()  # a server still booting (Ctrl-C, a timeout) would outlive the command
        _forget(server, previous)
        if not isinstance(error, RuntimeError):
            raise
        raise PrefectUnavailable(
            f"the temporary Prefect API did not start within {timeout} s ({error}); its log is {log}. "
            f"On a busy machine raise {_STARTUP_TIMEOUT_VARIABLE}, or point MLSTM_PREFECT_API_URL / "
            "PREFECT_API_URL at a running `prefect server start`"
        ) from None
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
        _forget(server, previous)


def _server_of_its_own() -> Any:
    """Prefect's temporary server, in a process group of its own, dying with this process.

    In this process's group, a terminal's Ctrl-C (sent to the whole group) stopped the server at the
    same moment as the command: the flow runs could no longer report their end, and the command hung
    on retries of the dead API and printed their tracebacks. Here only ``stop`` stops it, last; and a
    command killed outright (SIGKILL) takes it along (``tasks.processes.parented``).
    """
    import subprocess

    from prefect.server.api.server import SubprocessASGIServer

    from tasks.processes import parented

    def own_group_popen(args: list[str], *, env: dict[str, str], **options: Any) -> subprocess.Popen[Any]:
        command, more = parented(args)
        return popen(command, env={**env, **more}, process_group=0, **options)

    popen = subprocess.Popen

    class OwnGroupServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # Prefect builds the command and its environment; only how it is started changes.
            subprocess.Popen = own_group_popen  # type: ignore[misc,assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen  # type: ignore[misc]

    return OwnGroupServer()


_STARTUP_TIMEOUT_VARIABLE = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
# Prefect waits 20 s for its temporary server by default: on two busy cores its cold start took longer
# and the demo ended in a traceback. A value the user set is kept as it is.
_DEFAULT_STARTUP_TIMEOUT_S = 120


def _startup_timeout() -> int:
    """Seconds to wait for the temporary Prefect API: the user's setting, else a busy machine's."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    if _STARTUP_TIMEOUT_VARIABLE in os.environ:  # read here: Prefect's settings were read at import
        return int(os.environ[_STARTUP_TIMEOUT_VARIABLE])
    return max(int(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()), _DEFAULT_STARTUP_TIMEOUT_S)


def _forget(server: Any, previous: Any) -> None:
    """Give Prefect back the ephemeral server it had before ``prefect_api`` put ``server`` there."""
    from prefect.server.api.server import SubprocessASGIServer

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
        drained = EventsWorker.drain_all()
        if inspect.isawaitable(drained):
            await drained

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


LOCAL_CLUSTER = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:8787"}


def task_runner(settings: Settings) -> Any:
    """The Prefect task runner named by the settings; Dask and Ray need their Prefect integrations."""
    workers = settings.max_workers or cpu_count()
    if settings.task_runner == "process":
        from prefect.task_runners import ProcessPoolTaskRunner

        return ProcessPoolTaskRunner(max_workers=workers, initializer=ignore_ctrl_c)
    if settings.task_runner == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    if settings.task_runner == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError as error:
            raise RuntimeError("MLSTM_TASK_RUNNER=dask needs `pip install prefect-dask`") from error
        if settings.task_runner_address:
            return DaskTaskRunner(address=settings.task_runner_address)
        # One thread per worker process: MLSTM_MAX_WORKERS means parallel pieces, as for the pool. The
        # cluster is this machine's: its scheduler and dashboard listen on loopback only (Dask's
        # dashboard would otherwise take every interface's port 8787).
        return DaskTaskRunner(cluster_kwargs=LOCAL_CLUSTER | {"n_workers": workers, "threads_per_worker": 1})
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as error:
        raise RuntimeError("MLSTM_TASK_RUNNER=ray needs `pip install prefect-ray`") from error
    return RayTaskRunner(address=settings.task_runner_address)


def runner_for(settings: Settings, pieces: int) -> Settings:
    """The settings a run of ``pieces`` pieces takes: one piece runs on a thread of this process rather
    than on a process pool, whose worker's start (each importing pyarrow and Prefect, and torch and
    MLflow to score) was most of such a run (benchmarks/corpus_delta.py, benchmarks/score_fixed.py).
    A stop reaches that thread between batches (``flows.stopping``)."""
    if pieces <= 1 and settings.task_runner == "process":
        return settings.model_copy(update={"task_runner": "thread"})
    return settings


def ignore_ctrl_c() -> None:
    """A pool worker's start: the terminal's Ctrl-C, sent to the whole process group, is for the command.

    A worker that took it died mid-piece with a KeyboardInterrupt traceback on the terminal, and the
    command hung on its broken pool; the command stops its workers itself, once their pieces are done.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def local_dask_workers(settings: Settings) -> Iterator[None]:
    """Local Dask workers started inside run the features path as fast as a process pool's would.

    - Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` in its workers (and in this process's
      environment). Setting it at all turns off glibc's adaptive mmap threshold, so each of the features
      path's large, short-lived tensors is a fresh mmap whose pages fault in again. Measured (score,
      4,000 IMDB reviews, tiny, 2 workers): the process pool with the variable set 23.4 s, without
      19.3 s; Dask 23.7 s.
    - A worker's statistical profiler samples every thread's stack every 10 ms. The features path
      steps in Python, and each sample takes the GIL from it: on the whole IMDB test set (tiny, 2
      workers) the pieces took 202 s of work with it and 146 to 156 s without, against the pool's 126
      to 135 (``docs/benchmarks.md``). The dashboard's profile page is empty for these workers.

    A cluster given by address (``MLSTM_TASK_RUNNER_ADDRESS``) keeps its own settings: set them there
    (``DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False``)."""
    if settings.task_runner != "dask" or settings.task_runner_address:
        yield
        return
    import dask

    with dask.config.set(
        {
            "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
            "distributed.worker.profile.enabled": False,
        }
    ):
        yield


def check_cluster(store: Store, runner: Any) -> None:
    """Before any work on a Dask cluster: every worker reads back what this process just wrote to the
    store, and reaches the Prefect API its task runs report to.

    The pieces are written by one worker and read by another (and by this process for the manifest),
    so a folder on each worker's own disk would scatter the corpus over the workers' disks: it fails
    here, with the setting to change, instead of after the parse. Other runners run on this machine.
    """
    if type(runner).__module__.partition(".")[0] != "prefect_dask":
        return
    from prefect.settings import PREFECT_API_URL

    try:
        client = runner.client
    except OSError as error:  # distributed's "Timed out trying to connect to …"
        raise ClusterUnavailable(
            f"no Dask scheduler answers at {runner.address}: {error} [MLSTM_TASK_RUNNER_ADDRESS]"
        ) from None
    key = f"_cluster-check-{os.getpid()}-{id(runner):x}"
    token = os.urandom(16).hex().encode()
    store.write_bytes(key, token)
    try:
        answers = client.run(_worker_check, store, key, token, PREFECT_API_URL.value(), on_error="return")
    finally:
        store.delete_prefix(key)
    for worker, answer in sorted(answers.items()):
        problem = answer if isinstance(answer, str) else f"cannot run this project's code ({answer!r})"
        if not problem:
            continue
        if problem.startswith("store"):
            where = (
                "a folder on this machine; use s3://… or a folder every worker mounts at the same path"
                if isinstance(store, LocalStore)
                else "give the workers the same endpoint and credentials"
            )
            raise StoreError(
                f"Dask worker {worker} cannot read the store {store.uri}: {problem.partition(': ')[2]} "
                f"(the workers write the corpus there and read each other's pieces: {where}) "
                "[MLSTM_STORE_URI]"
            )
        raise PrefectUnavailable(
            f"Dask worker {worker} {problem}: its task runs report to that API, so run a Prefect server "
            "the workers can reach [MLSTM_PREFECT_API_URL]"
        )


def _worker_check(store: Store, key: str, token: bytes, api_url: str | None) -> str:
    """Run on each Dask worker: '' when it sees the store and the API, else what it cannot do."""
    import httpx

    try:
        if store.read_bytes(key) != token:
            return "store: it holds other bytes under the same name (another folder)"
    except Exception as error:
        return f"store: {type(error).__name__}: {error}"
    if api_url:
        try:
            httpx.get(f"{api_url.rstrip('/')}/health", timeout=10).raise_for_status()
        except httpx.HTTPError as error:
            return f"cannot reach the Prefect API at {api_url} ({error})"
    return ""


def submit_deployment(name: str, parameters: dict[str, Any]) -> str:
    """Create a flow run of deployment ``flow/deployment`` for a worker to pick up; returns its id."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    if "/" not in name:
        raise ValueError(f"--deployment {name}: write FLOW/DEPLOYMENT, e.g. pipeline/pipeline-weekly")
    try:
        flow_run = run_deployment(name, parameters=parameters, timeout=0)
        assert not inspect.isawaitable(flow_run)  # called outside an event loop: run_deployment is sync
    except ObjectNotFound:
        raise ValueError(
            f"no deployment {name} on the Prefect server: `mlstm-sentiment deploy` creates those in "
            "infra/prefect.yaml; `prefect deployment ls` lists what is there"
        ) from None
    return str(flow_run.id)


def follow_flow_run(flow_run_id: str, *, on_log: Callable[[str], None], poll_seconds: float = 2.0) -> str:
    """Pass on a flow run's logs until it ends; returns its final state type (COMPLETED, FAILED, …).
    Ctrl-C cancels the flow run, as it would a local one."""
    import time
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.states import Cancelling

    run_id = UUID(flow_run_id)
    seen = 0
    with get_client(sync_client=True) as client:

        def drain() -> None:
            nonlocal seen
            logs = client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                offset=seen,
                sort=LogSort.TIMESTAMP_ASC,
            )
            for log in logs:
                on_log(f"{log.timestamp:%H:%M:%S} {log.message}")
            seen += len(logs)

        try:
            while True:
                state = client.read_flow_run(run_id).state
                drain()
                if state is not None and state.is_final():
                    time.sleep(poll_seconds)  # the last lines reach the API after the state does
                    drain()
                    return state.type.value
                time.sleep(poll_seconds)
        except KeyboardInterrupt:
            client.set_flow_run_state(run_id, Cancelling(message="cancelled from the CLI"), force=True)
            raise


def retry_unless(*permanent: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A task's ``retry_condition_fn``: a failure may pass on a retry (a network, a store, a lost node)
    unless it is one of ``permanent``, which the same input would raise again."""

    def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
        try:
            state.result()
        except permanent:
            return False
        except Exception:
            return True
        return True

    return worth_retrying
