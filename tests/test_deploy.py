"""infra/prefect.yaml deployed as an operator deploys it, against a real `prefect server` on loopback:
`mlstm-sentiment deploy`, workers that pick the runs up, a run through the CLI's --deployment, and a
cancelled training run that leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Invoked, cli_in_process, free_port
from processes import stop_group

from tasks.corpus.sample import write_sample

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLI = str(BIN / "mlstm-sentiment")
PREFECT = str(BIN / "prefect")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`prefect server start` with a database of its own, and an environment that talks to it."""
    root = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "MLSTM_HOME": str(root / "home"),
        "MLSTM_TASK_RUNNER": "thread",
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
    }
    log = (root / "server.log").open("wb")
    command = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{env['PREFECT_API_URL']}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()
            time.sleep(0.5)
        yield env
    finally:
        stop_group(process)
        log.close()


def _deploy(env: dict[str, str]) -> Invoked:
    """`mlstm-sentiment deploy` from the repository root, in this process: the rule is what it makes on
    the server, not the command's own interpreter (whose imports of Prefect, torch, scikit-learn and
    MLflow cost about 7 s of CPU a run). Its `prefect deploy` is a process of its own, as for a user."""
    path = list(sys.path)
    before = set(sys.modules)
    try:
        with contextlib.chdir(ROOT):
            return cli_in_process(["deploy"], {**env})
    finally:
        # Prefect's loader (the deployments' names) leaves each flow script in sys.modules under its
        # file's name (`corpus`, `score`) and flows/ on sys.path: a later test of this worker importing
        # `score` (benchmarks/score_fixed.py does) would get flows/score.py.
        sys.path[:] = path
        for name in set(sys.modules) - before:  # the scripts' bare names, not the package or its flows.*
            file = Path(getattr(sys.modules[name], "__file__", None) or "/")
            if "." not in name and file.parent == ROOT / "flows" and file.name != "__init__.py":
                del sys.modules[name]


@pytest.fixture(scope="module")
def deployed(server: dict[str, str]) -> dict[str, str]:
    done = _deploy(server)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "created work pool cpu" in done.stdout
        and "created concurrency limit pretrain-gpus = 1" in done.stdout
    )
    return server


@pytest.fixture
def worker(deployed: dict[str, str]) -> Iterator[Any]:
    """``worker(pool)`` starts `prefect worker start --pool POOL`; all stop at the end of the test."""
    started: list[subprocess.Popen[bytes]] = []

    def start(pool: str) -> subprocess.Popen[bytes]:
        command = [PREFECT, "worker", "start", "--pool", pool, "--prefetch-seconds", "5"]
        process = subprocess.Popen(
            command, cwd=ROOT, env=deployed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        started.append(process)
        return process

    yield start
    for process in started:  # a worker slow to stop is killed with its flow runs, never left running
        stop_group(process)


def _client(env: dict[str, str]) -> Any:
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(env["PREFECT_API_URL"])


def _run_deployment(env: dict[str, str], name: str, params: dict[str, Any]) -> str:
    command = [PREFECT, "deployment", "run", name, "--params", json.dumps(params)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split("UUID:")[1].split()[0]


def _wait_for(env: dict[str, str], flow_run_id: str, states: set[str], timeout: float = 300) -> str:
    with _client(env) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and state.type.value in states:
                return state.type.value
            time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} never reached {states}")


@pytest.mark.slow  # a Prefect server starts, then two deploys: about 60 s
def test_deploy_creates_pools_limits_and_every_deployment_idempotently(deployed: dict[str, str]) -> None:
    again = _deploy(deployed)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "work pool cpu exists" in again.stdout and "concurrency limit pretrain-gpus = 1" in again.stdout
    with _client(deployed) as client:
        pools = {pool.name: pool for pool in client.read_work_pools()}
        assert pools["cpu"].type == pools["gpu"].type == "process"
        assert pools["gpu"].concurrency_limit == 1
        assert client.read_global_concurrency_limit_by_name("pretrain-gpus").limit == 1
        deployments = {d.name: d for d in client.read_deployments()}
    assert set(deployments) == {
        "corpus-refresh",
        "pretrain",
        "sweep-paper-4096",
        "transfer-nightly",
        "pipeline-weekly",
        "score-nightly",
    }
    crons = {name: [s.schedule.cron for s in d.schedules] for name, d in deployments.items()}  # type: ignore[union-attr]
    assert crons == {
        "corpus-refresh": ["0 3 * * 1"],
        "pretrain": [],
        "sweep-paper-4096": [],
        "transfer-nightly": ["0 2 * * *"],
        "pipeline-weekly": ["0 6 * * 1"],
        "score-nightly": ["30 4 * * *"],
    }
    assert deployments["pretrain"].work_pool_name == "gpu"
    assert deployments["pretrain"].global_concurrency_limit is not None
    # The UI's form: typed parameters, nested models included.
    schema = deployments["pipeline-weekly"].parameter_openapi_schema
    assert "PipelineParams" in json.dumps(schema) and "PretrainStage" in json.dumps(schema)


def test_a_missing_file_or_deployment_name_is_one_clear_error(
    deployed: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env: dict[str, str | None] = {"PREFECT_API_URL": deployed["PREFECT_API_URL"]}
    missing = cli_in_process(["deploy", "--file", str(tmp_path / "nope.yaml")], env)
    assert missing.returncode == 2 and "nope.yaml: no such file" in missing.stderr
    monkeypatch.chdir(ROOT)
    unknown = cli_in_process(["deploy", "--name", "nightly"], env)
    assert unknown.returncode == 2 and "declares no deployment nightly" in unknown.stderr


@pytest.mark.long  # Prefect workers picking up runs: about 100 s with the teardown
def test_runs_of_deployments_complete_on_workers(
    deployed: dict[str, str], worker: Any, tmp_path: Path
) -> None:
    sample = write_sample(tmp_path / "sample", num_reviews=600)[0].parent
    worker("cpu")
    # A run of the weekly corpus refresh, created as `prefect deployment run` creates it.
    flow_run_id = _run_deployment(
        deployed, "build_corpus/corpus-refresh", {"sources": [str(sample)], "config": {"split": [90, 5, 5]}}
    )
    assert _wait_for(deployed, flow_run_id, {"COMPLETED", "FAILED", "CRASHED"}) == "COMPLETED"
    store = Path(deployed["MLSTM_HOME"]) / "store"
    assert len(list(store.glob("corpora/*/manifest.json"))) == 1

    # A stage rerun through a deployment from the CLI: submitted, followed, read back from MLflow.
    args = ["run", "corpus", "--set", f'sources=["{sample}"]', "--set", "corpus.split=[90,5,5]"]
    args += ["--deployment", "pipeline/transfer-nightly", "--json"]
    done = subprocess.run(
        [CLI, *args], cwd=tmp_path, env=deployed, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stages"]["corpus"]["state"] == "ran"  # forced: `run` reruns the stage
    assert "waiting for a worker" in done.stderr


@pytest.mark.long  # about 100 s; test_slurm's and test_pretrain's cancel and kill tests stay in make test
def test_cancelling_a_training_run_stops_every_process(
    deployed: dict[str, str], worker: Any, tmp_path: Path
) -> None:
    sample = write_sample(tmp_path / "sample", num_reviews=600)[0].parent
    built = subprocess.run(
        [CLI, "corpus", "build", str(sample), "--split", "90:5:5", "--json"],
        env={**deployed, "MLSTM_HOME": str(tmp_path / "home")}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    manifest = json.loads(built.stdout)["manifest_uri"]
    worker("gpu")
    params = {
        "corpus": manifest, "preset": "tiny", "launcher": "local", "nodes": 1, "gpus_per_node": 0, "nproc": 2,
        "batch_size": 16, "seq_len": 64, "max_steps": 100000, "total_steps": 100000, "run": "cancelled",
        "checkpoint_every": 100000, "val_every": 100000,
    }  # fmt: skip
    env = {**deployed, "MLSTM_HOME": str(tmp_path / "home")}
    flow_run_id = _run_deployment(env, "pretrain/pretrain", {"params": params})
    log = Path(deployed["MLSTM_HOME"]) / "jobs" / "cancelled.log"
    deadline = time.monotonic() + 240
    while not (log.exists() and "step=20 " in log.read_text()):
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.5)
    assert _training_processes(), "no training process to stop"
    cancel = subprocess.run([PREFECT, "flow-run", "cancel", flow_run_id], env=deployed, capture_output=True)
    assert cancel.returncode == 0, cancel.stderr
    # The run ends (Cancelled, or Crashed when the flow's own SIGTERM handling wins the race with the
    # worker's cancellation: both are final, neither leaves a process), never Completed or Failed.
    assert _wait_for(deployed, flow_run_id, {"CANCELLED", "FAILED", "CRASHED", "COMPLETED"}) in {
        "CANCELLED",
        "CRASHED",
    }
    deadline = time.monotonic() + 60
    while _training_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    leftover = _training_processes()
    for line in leftover:  # never leave them running for the rest of the suite
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not leftover, leftover


def _training_processes() -> list[str]:
    listing = subprocess.run(["pgrep", "-af", "--", "--run-name cancelled"], capture_output=True, text=True)
    return [
        line for line in listing.stdout.splitlines() if "tasks.pretrain.train" in line and "pgrep" not in line
    ]
