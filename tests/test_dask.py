"""The corpus stage on a real Dask cluster: a scheduler and two workers, separate processes on loopback
started from the venv's `dask` command, each in its own process group so none outlives the test."""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, wait_for_port
from corpus_helpers import shard_digests

from tasks.corpus.build import CorpusConfig, plan_corpus

pytest.importorskip("prefect_dask", reason="needs the dask extra: pip install '.[dask]'")
pytestmark = pytest.mark.slow

DASK = str(Path(sys.executable).parent / "dask")
# Small pieces so that a build has several in flight at once, and a worker can die in one of them.
CONFIG = CorpusConfig(split=(98, 1, 1), piece_mb=1)


@dataclass
class Cluster:
    address: str
    logs: Path
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # by name
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self, name: str, *, prefix: list[str] | None = None) -> None:
        command = [
            *(prefix or []), DASK, "worker", self.address, "--name", name, "--nthreads", "1",
            "--no-nanny", "--no-dashboard", "--death-timeout", "30",
            "--local-directory", str(self.logs / name),
        ]  # fmt: skip
        log = (self.logs / f"{name}.log").open("wb")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.workers[name] = process
        self.processes.append(process)

    def wait_for_workers(self, count: int, timeout: float = 120) -> None:
        from distributed import Client

        with Client(self.address, timeout=timeout) as client:
            client.wait_for_workers(count, timeout=timeout)

    def kill(self, name: str) -> None:
        os.killpg(self.workers[name].pid, signal.SIGKILL)
        self.workers[name].wait()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    port = free_port()
    logs = tmp_path / "dask"
    logs.mkdir()
    # --idle-timeout: should this test die without its finalizer, the scheduler stops by itself and
    # the workers (--death-timeout) follow it.
    scheduler = subprocess.Popen(
        [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
         "--idle-timeout", "300"],
        stdout=(logs / "scheduler.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    running = Cluster(f"tcp://127.0.0.1:{port}", logs, processes=[scheduler])
    try:
        wait_for_port(port, timeout=60)
        yield running
    finally:
        for process in running.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory, amazon_dir: Path) -> list[str]:
    """7.4 MB of plain JSON lines (a piece per MiB) and a .json.gz file (one piece)."""
    folder = tmp_path_factory.mktemp("raw")
    plain = folder / "reviews_Musical_Instruments_5.json"
    plain.write_bytes(gzip.decompress((amazon_dir / "reviews_Musical_Instruments_5.json.gz").read_bytes()))
    shutil.copy(amazon_dir / "Gift_Cards_5.json.gz", folder)
    return [str(plain), str(folder / "Gift_Cards_5.json.gz")]


def _build(raw: list[str], store: Path, runner: str, address: str | None = None) -> dict[str, Any]:
    from flows.cli.corpus import run_corpus_build

    env = {"MLSTM_TASK_RUNNER": runner, "MLSTM_MAX_WORKERS": "2"}
    if address:
        env["MLSTM_TASK_RUNNER_ADDRESS"] = address
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return run_corpus_build(raw, store=str(store), config=CONFIG, show_progress=False).model_dump()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def pool_build(
    raw: list[str], prefect_api_url: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    """The same corpus built by Prefect's process pool, the default runner: what Dask must match."""
    store = tmp_path_factory.mktemp("pool") / "store"
    return store, _build(raw, store, "process")


def _digests(store: Path, summary: dict[str, Any]) -> list[tuple[str, str]]:
    import json

    manifest = json.loads(Path(summary["manifest_uri"]).read_text())
    assert Path(summary["manifest_uri"]).is_relative_to(store)
    return shard_digests(store, manifest)


# About 40 s for the two cluster builds and 30 s more for the process pool's on two busy cores.
@pytest.mark.long
def test_the_cluster_builds_the_same_corpus_as_the_process_pool(
    cluster: Cluster, raw: list[str], pool_build: tuple[Path, dict[str, Any]], home: Path, tmp_path: Path
) -> None:
    for name in ("w1", "w2"):
        cluster.start_worker(name)
    cluster.wait_for_workers(2)
    pool_store, pool_summary = pool_build
    num_pieces = len(plan_corpus(raw, CONFIG).pieces)
    assert num_pieces >= 8

    summary = _build(raw, tmp_path / "store", "dask", cluster.address)
    assert summary == {**pool_summary, "manifest_uri": summary["manifest_uri"]}
    assert _digests(tmp_path / "store", summary) == _digests(pool_store, pool_summary)

    # A worker killed in the middle of a piece: the scheduler gives the piece to the other worker,
    # the piece starts over (its half-written files were never published) and the bytes are the same.
    from distributed import Client

    store = tmp_path / "store-killed"
    markers = store / "corpora" / pool_summary["corpus_id"] / "_work" / "map"
    killed: dict[str, Any] = {}

    def kill_w1_mid_piece() -> None:
        with Client(cluster.address, timeout=60) as client:
            w1 = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "w1")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                busy = client.processing(workers=[w1])[w1]
                if busy and list(markers.glob("*/_SUCCESS.json")):
                    killed["pieces done before"] = len(list(markers.glob("*/_SUCCESS.json")))
                    killed["busy with"] = busy
                    cluster.kill("w1")
                    return
                time.sleep(0.02)

    killer = threading.Thread(target=kill_w1_mid_piece)
    killer.start()
    summary = _build(raw, store, "dask", cluster.address)
    killer.join()
    assert killed, "w1 was never caught mid-piece"
    assert 1 <= killed["pieces done before"] < num_pieces
    assert cluster.workers["w1"].poll() is not None  # it stayed dead: w2 did the rest
    assert summary == {**pool_summary, "manifest_uri": summary["manifest_uri"]}
    assert _digests(store, summary) == _digests(pool_store, pool_summary)


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    done = subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare --mount --map-root-user`")
def test_a_store_folder_the_workers_do_not_share_is_an_error_before_any_work(
    cluster: Cluster, raw: list[str], prefect_api_url: str, home: Path, tmp_path: Path
) -> None:
    # The worker runs in a mount namespace of its own with an empty tmpfs over the store's parent:
    # the same path, another disk, as on a worker machine of its own.
    store = tmp_path / "private" / "store"
    store.parent.mkdir()
    own_disk = ["unshare", "--mount", "--map-root-user", "sh", "-c", f'mount -t tmpfs none "{store.parent}" && exec "$0" "$@"']  # fmt: skip
    cluster.start_worker("elsewhere", prefix=own_disk)
    cluster.wait_for_workers(1)

    with pytest.raises(Exception, match=r"cannot read the store") as raised:
        _build(raw, store, "dask", cluster.address)
    message = str(raised.value)
    assert str(store) in message and "MLSTM_STORE_URI" in message and "mounts at the same path" in message
    assert not list(store.rglob("*.arrow")), "pieces were parsed before the check"
    assert not (store / "corpora").exists()


def test_the_cli_says_when_no_scheduler_answers(prefect_api_url: str, home: Path, tmp_path: Path) -> None:
    source = tmp_path / "reviews.json"
    source.write_text('{"reviewText": "Fine.", "overall": 5}\n')
    env = {
        **os.environ,
        "MLSTM_TASK_RUNNER": "dask",
        "MLSTM_TASK_RUNNER_ADDRESS": f"tcp://127.0.0.1:{free_port()}",
        "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s",
    }
    cli = str(Path(sys.executable).parent / "mlstm-sentiment")
    done = subprocess.run(
        [cli, "corpus", "build", str(source), "--store", str(tmp_path / "store")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "no Dask scheduler answers at tcp://127.0.0.1:" in done.stderr
    assert "MLSTM_TASK_RUNNER_ADDRESS" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.long
def test_a_ray_cluster_builds_the_same_corpus_as_the_process_pool(
    raw: list[str], pool_build: tuple[Path, dict[str, Any]], home: Path, tmp_path: Path
) -> None:
    # Ray is not in the dask extra (278 MB, about 1.5 min to install here): where it is installed, a
    # head node started from the venv's `ray`, in its own process group, runs the same build.
    pytest.importorskip("prefect_ray", reason="needs ray and prefect-ray")
    import tempfile

    port = free_port()
    # Short: Ray's Unix sockets live under it, and a socket path is limited to about 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port", str(port),
        "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(temp),
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = (tmp_path / "ray.log").open("wb")
    head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_port(port, timeout=180)
        pool_store, pool_summary = pool_build
        summary = _build(raw, tmp_path / "store", "ray", f"127.0.0.1:{port}")
        assert summary == {**pool_summary, "manifest_uri": summary["manifest_uri"]}
        assert _digests(tmp_path / "store", summary) == _digests(pool_store, pool_summary)
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)
