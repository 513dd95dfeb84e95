"""Shared fixtures: the real data beside the checkout, a Prefect API, a moto S3 server, an HTTP
server, all on loopback and all started once per session."""

from __future__ import annotations

import contextlib
import csv
import functools
import gzip
import http.server
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from processes import SESSION_VARIABLE, started_by_session

from tasks.jobs.threads import thread_share, usable_cores  # imports no torch: the share is set before it

# The costliest test files first, for pytest-xdist (tests/schedule.py).
pytest_plugins = ["schedule"]

# Before anything imports prefect or mlflow: a private Prefect home, quiet consoles, no telemetry.
_SESSION_HOME = Path(tempfile.mkdtemp(prefix="mlstm-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_HOME / "prefect")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
os.environ.pop("PREFECT_API_URL", None)
# Read before the MLSTM_ variables are cleared below, or a worktree elsewhere never finds the data.
SHARED = Path(os.environ.get("MLSTM_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
for name in [n for n in os.environ if n.startswith("MLSTM_") and not n.startswith("MLSTM_REQUIRE_")]:
    del os.environ[name]
# One checkpoint key for the session, as a team shares one: a checkpoint a test saves under one home (or
# none, which would make a key in the checkout's .mlstm-sentiment) reads under another test's. The tests of
# the key made under MLSTM_HOME unset it, each with a home of its own.
os.environ["MLSTM_CHECKPOINT_KEY"] = uuid.uuid4().hex
# MLflow's own variables are settings too (below ours): a developer's exported tracking server must not
# receive the tests' runs.
_MLFLOW_STATE = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_REGISTRY_URI",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_RUN_ID",
)
for name in _MLFLOW_STATE:
    os.environ.pop(name, None)
# Under several pytest-xdist workers, each worker and every process it starts gets its share of the cores
# as OpenMP (and so torch, MKL and OpenBLAS) threads: two workers each spinning two threads on two cores
# ran a small training loop more than 4× slower than one thread each did. With one worker the processes
# size their own threads (tasks/jobs/threads.py).
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(thread_share(cores=usable_cores(), sharers=workers)))
# One worker process for a flow's process pool (a corpus build's pieces, a score run's): each worker imports
# Prefect, torch and the stage's code (3-8 s of CPU) before its first task, and the suite's own workers
# keep the cores busy anyway. The tests of several workers at once set their own.
os.environ["MLSTM_MAX_WORKERS"] = "1"
# Ctrl-C's default action for the suite and every process it starts, as a terminal gives it: a shell starts
# its background jobs with SIGINT ignored, a disposition children inherit, and a Python started so never
# raises KeyboardInterrupt (the Ctrl-C tests then saw commands ignore the signal).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Every process the suite starts inherits this, so the session's end finds any that outlived it.
_SESSION_TOKEN = uuid.uuid4().hex
os.environ[SESSION_VARIABLE] = _SESSION_TOKEN


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A long test is slow too, so `-m "not slow"` stays the quick loop.
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Set up first, so torn down last: no process the suite started may be alive at its end."""
    yield
    if not Path("/proc/self/environ").exists():
        return
    # A process pool's queues (Prefect's process pool runner) start multiprocessing's resource tracker
    # in this process: it lives as long as this process does, so it is stopped here, not counted.
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()
    deadline = time.monotonic() + 15  # processes stopped at the very end may still be exiting
    while (left := started_by_session(_SESSION_TOKEN)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for line in left:  # never leave them running for the next session
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), 9)
    assert not left, "processes started by the tests outlived them:\n" + "\n".join(left)


AMAZON = SHARED / "data" / "amazon"


def _require_shared() -> Path:
    if not (SHARED / "data").is_dir():
        if os.environ.get("MLSTM_REQUIRE_SHARED_DATA") == "1":
            pytest.fail(f"the shared data is required here but {SHARED / 'data'} is missing")
        pytest.skip(f"needs the shared data at {SHARED / 'data'} (set MLSTM_SHARED_DIR)")
    return SHARED / "data"


@pytest.fixture(autouse=True)
def _mlflow_state_reset() -> Iterator[None]:
    """MLflow's fluent API keeps process-wide state (tracking and registry URI, active experiment and run)
    and mirrors it into MLFLOW_* variables, which the project reads as settings: left over, one test's
    server or database becomes the next one's. Every test starts from none of it."""
    yield
    if "mlflow" in sys.modules:
        import mlflow
        from mlflow.tracking import fluent

        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]
        mlflow.set_registry_uri(None)  # type: ignore[arg-type]
        fluent._active_experiment_id = None
    for name in _MLFLOW_STATE:
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return _require_shared()


@pytest.fixture(scope="session")
def amazon_dir(shared_data: Path) -> Path:
    return shared_data / "amazon"


@pytest.fixture(scope="session")
def amazon_complete(amazon_dir: Path) -> list[Path]:
    """The complete (not sliced) files of all three releases."""
    return sorted(p for p in amazon_dir.glob("*.gz"))


@pytest.fixture(scope="session")
def sample_manifest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """URI of a corpus of generated reviews (2,368 train rows): needs nothing beside the checkout."""
    from corpus_helpers import build

    from tasks.corpus.build import CorpusConfig
    from tasks.corpus.sample import write_sample

    root = tmp_path_factory.mktemp("sample-corpus")
    files = write_sample(root / "raw", num_reviews=3000)
    manifest = build(files, root / "store", CorpusConfig(split=(18, 1, 1)))
    return str(root / "store" / "corpora" / manifest.corpus_id / "manifest.json")


@pytest.fixture(scope="session")
def amazon_manifest(amazon_complete: list[Path], tmp_path_factory: pytest.TempPathFactory) -> str:
    """URI of the corpus of every complete Amazon file, built once per session: the training and
    sweep tests read it, none writes to its store."""
    from corpus_helpers import build

    from tasks.corpus.build import CorpusConfig

    root = tmp_path_factory.mktemp("amazon-corpus")
    manifest = build(amazon_complete, root / "store", CorpusConfig(split=(98, 1, 1)))
    return str(root / "store" / "corpora" / manifest.corpus_id / "manifest.json")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh MLSTM home (store, MLflow database, caches) for one test."""
    monkeypatch.setenv("MLSTM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A script of benchmarks/ loaded as module ``name``. benchmarks/ is no package: its folder goes on
    sys.path, as when the script is run (for benchmarks/common.py); the monkeypatch undoes both."""
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Invoked:
    """What the command line gave: its exit code and its two streams."""

    returncode: int
    stdout: str
    stderr: str


def cli_in_process(args: list[str], env: dict[str, str | None] | None = None) -> Invoked:
    """``mlstm-sentiment ARGS`` run in this process by Typer's runner, with ``env`` over this process's
    environment (None unsets), for an error that must come before any work: the same code as the
    command, without a new interpreter importing torch, scikit-learn, Prefect and MLflow (10–17 s each
    on two cores). An exception that escapes the command is raised here: a user would see a traceback."""
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, args, env=env, terminal_width=200)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Invoked(result.exit_code, result.stdout, result.stderr)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@pytest.fixture(scope="session")
def prefect_api_url() -> Iterator[str]:
    """Prefect's test harness: one real API server for the session, on a temporary database.
    Subprocesses (the CLI, worker processes) reach it through PREFECT_API_URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        url = PREFECT_API_URL.value()
        os.environ["PREFECT_API_URL"] = url
        yield url
    os.environ.pop("PREFECT_API_URL", None)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server on loopback; boto3 finds it through AWS_ENDPOINT_URL."""
    port = free_port()
    moto = Path(sys.executable).parent / "moto_server"
    process = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        wait_for_port(port)
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A new empty bucket on the moto server."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def http_root() -> Iterator[tuple[str, Path]]:
    """An HTTP server on loopback serving a folder: (base URL, folder)."""
    root = Path(tempfile.mkdtemp(prefix="mlstm-http-"))
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server and model registry on loopback (SQLite, local artifacts)."""
    with mlflow_server_in(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


@contextlib.contextmanager
def mlflow_server_in(root: Path) -> Iterator[str]:
    """An MLflow server whose database, artifacts and log are in ``root``; its URL."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job workers on 2 cores
    command = [
        str(Path(sys.executable).parent / "mlflow"), "server", "--workers", "1",
        "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = (root / "server.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_port(port, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, 15)
        process.wait(timeout=30)
        log.close()


@pytest.fixture
def fault_proxy(s3_server: str) -> Iterator[object]:
    """``fault_proxy(fault)`` starts a ``fault_proxy.FaultProxy`` in front of the moto server and
    returns it; every proxy started stops at the end of the test."""
    from fault_proxy import proxies

    with proxies(s3_server) as start:
        yield start


# The score tests' champion and IMDB slice (test_score.py, test_score_workers.py): module-scoped, so each
# file of them trains and registers its own champion under an MLSTM_HOME of its own. score_helpers is
# imported inside them, so nothing of the project's is imported before the environment above is set.


@pytest.fixture(scope="module")
def scoring_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """MLSTM_HOME for the module: its MLflow database holds the champion. A run has one worker process
    (conftest); the test of every row once takes two."""
    home = tmp_path_factory.mktemp("score-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(home))
        yield home


@pytest.fixture(scope="module")
def champion(scoring_home: Path, shared_data: Path, prefect_api_url: str) -> dict[str, Any]:
    """A tiny classifier trained here: a random tiny mLSTM's features of 200 IMDB train reviews and an
    L2 logistic probe on them, logged and registered as models:/mlstm-sentiment@champion."""
    import mlflow
    import torch
    from mlflow.tracking import MlflowClient
    from score_helpers import imdb_rows
    from sklearn.linear_model import LogisticRegression

    from models.classifier import SentimentClassifier
    from models.features import featurize
    from models.mlstm import MLSTM, tiny
    from tasks.settings import get_settings
    from tasks.tracking import connect
    from tasks.transfer.registry import log_classifier

    rows = imdb_rows(shared_data / "imdb" / "train.csv.gz", every=125, limit=200)
    torch.manual_seed(0)
    model = MLSTM(tiny())
    features_NH = featurize(model, [r["text"] for r in rows], batch_size=None)
    probe = LogisticRegression(C=1.0, max_iter=1000).fit(features_NH, [int(r["label"]) for r in rows])
    classifier = SentimentClassifier(model, probe.coef_[0], float(probe.intercept_[0]))
    settings = get_settings()
    connect(settings)
    with mlflow.start_run() as run:
        pass
    uri = log_classifier(run.info.run_id, classifier, "classifier")
    version = mlflow.register_model(uri, settings.model_name)
    MlflowClient().set_registered_model_alias(settings.model_name, "champion", version.version)
    return {"classifier": classifier, "version": int(version.version), "run_id": run.info.run_id}


@pytest.fixture(scope="module")
def imdb_slice(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SLICE_ROWS reviews of the IMDB test set, as the shared file is: gzip CSV id,rating,label,text."""
    from score_helpers import SLICE_ROWS, imdb_rows

    rows = imdb_rows(shared_data / "imdb" / "test.csv.gz", every=100, limit=SLICE_ROWS)
    path = tmp_path_factory.mktemp("imdb-slice") / "test-slice.csv.gz"
    with gzip.open(path, "wt", encoding="utf-8", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=["id", "rating", "label", "text"])
        writer.writeheader()
        writer.writerows(rows)
    return path
