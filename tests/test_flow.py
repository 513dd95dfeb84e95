"""The corpus stage as users run it: the Prefect flow, the CLI, MLflow, and a build killed half-way."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from corpus_helpers import SUMMARY_KEYS, build, parsed_pieces, shard_digests

import flows
from flows.cli.corpus import run_corpus_build
from tasks.corpus.build import CorpusConfig, plan_corpus

SMALL_SPLIT = CorpusConfig(split=(98, 1, 1))
CLI = str(Path(sys.executable).parent / "mlstm-sentiment")


def test_the_package_under_test_is_the_installed_one() -> None:
    # `make test` installs the distribution; a stray checkout on sys.path would hide packaging bugs.
    if os.environ.get("MLSTM_REQUIRE_SHARED_DATA") != "1":
        pytest.skip("checked where `make test` installs the package (CI)")
    assert "site-packages" in str(Path(flows.__file__).resolve())


async def _flow_runs_and_artifacts(flow_run_name: str | None = None) -> tuple[list[Any], list[Any]]:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        runs = await client.read_flow_runs()
        artifacts = await client.read_artifacts()
    return runs, artifacts


def _mlflow_runs(home: Path, corpus_id: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(home / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("mlstm-sentiment")
    return client.search_runs([experiment.experiment_id], filter_string=f"tags.corpus_id = '{corpus_id}'")


@pytest.mark.slow
def test_flow_builds_publishes_artifacts_and_logs_to_mlflow(
    prefect_api_url: str, home: Path, amazon_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.corpus import parse_piece_task, reduce_bucket_task

    # What each task is sent (test_corpus.py measures why): the plan without its pieces, and a
    # reduce task the ids of its bucket's pieces, not every piece's result.
    sent: dict[str, Any] = {}

    def spy(name: str, real: Any) -> Any:
        def mapped(*args: Any, **kwargs: Any) -> Any:
            sent[name] = args
            return real(*args, **kwargs)

        return mapped

    monkeypatch.setattr(parse_piece_task, "map", spy("parse", parse_piece_task.map))
    monkeypatch.setattr(reduce_bucket_task, "map", spy("reduce", reduce_bucket_task.map))
    monkeypatch.setenv("MLSTM_MAX_WORKERS", "2")  # two worker processes write pieces and buckets at once
    sources = [str(amazon_dir / "Gift_Cards_5.json.gz"), str(amazon_dir / "Appliances_5.json.gz")]
    summary = run_corpus_build(sources, store=None, config=SMALL_SPLIT, show_progress=False).model_dump()
    assert sent["parse"][0].pieces == sent["reduce"][0].pieces == ()
    inputs = sent["reduce"][3]  # per bucket, the ids of the pieces that wrote it
    assert all(isinstance(ids, tuple) for ids in inputs) and "s00000-p0000" in inputs[0]
    assert set(summary) == SUMMARY_KEYS
    manifest_path = Path(summary["manifest_uri"])
    assert manifest_path.is_file() and manifest_path.is_relative_to(home.resolve() / "store")
    manifest = json.loads(manifest_path.read_text())
    assert summary["rows"] == manifest["totals"]["kept"] > 2000
    assert summary["duplicates"] >= 2074  # Appliances repeats most of its records
    assert summary["rejected"] == 6  # Gift_Cards: reviews without text

    runs, artifacts = asyncio.run(_flow_runs_and_artifacts())
    ours = [r for r in runs if r.parameters.get("sources") == sources]
    assert len(ours) == 1 and ours[0].state.is_completed()
    keys = {a.key for a in artifacts if a.flow_run_id == ours[0].id}
    assert {"corpus-sources", "corpus-manifest"} <= keys
    table = next(a for a in artifacts if a.key == "corpus-sources" and a.flow_run_id == ours[0].id)
    assert "Gift_Cards_5.json.gz" in str(table.data)

    (run,) = _mlflow_runs(home, summary["corpus_id"])
    assert run.data.tags["manifest_uri"] == summary["manifest_uri"]
    assert run.data.metrics["records_kept"] == summary["rows"]
    assert run.data.params["split"] == "98:1:1"

    # Built already: the answer comes without a new flow run.
    started = time.perf_counter()
    assert (
        run_corpus_build(sources, store=None, config=SMALL_SPLIT, show_progress=False).model_dump() == summary
    )
    assert time.perf_counter() - started < 5
    runs_after, _ = asyncio.run(_flow_runs_and_artifacts())
    assert len([r for r in runs_after if r.parameters.get("sources") == sources]) == 1


def _cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli_env(prefect_api_url: str, home: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": prefect_api_url, "MLSTM_HOME": str(home)}


@pytest.mark.slow
def test_cli_json_show_and_rejected(cli_env: dict[str, str], amazon_dir: Path) -> None:
    source = str(amazon_dir / "AMAZON_FASHION_5.json.gz")
    done = _cli("corpus", "build", source, "--split", "98:1:1", "--json", env=cli_env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)  # stdout holds the JSON and nothing else
    assert summary["rejected"] == 16 and summary["rows"] + summary["duplicates"] + 16 == 3176


@pytest.mark.slow
def test_cli_grows_a_corpus_by_a_delta_through_the_flow(
    cli_env: dict[str, str], home: Path, amazon_dir: Path
) -> None:
    """``--base newest`` from the command line: the flow builds the delta and its artifact says so (the
    refusals and ``corpus show`` are tested in this process: tests/test_corpus_delta.py)."""
    gift, appliances, fashion = (
        str(amazon_dir / name)
        for name in ("Gift_Cards_5.json.gz", "Appliances_5.json.gz", "AMAZON_FASHION_5.json.gz")
    )
    first = build([gift, appliances], home / "store", SMALL_SPLIT)  # the base, in this process
    grown = _cli(
        "corpus", "build", gift, appliances, fashion, "--split", "98:1:1", "--base", "newest", "--json",
        env=cli_env,
    )  # fmt: skip
    assert grown.returncode == 0, grown.stderr
    summary = json.loads(grown.stdout)
    manifest = json.loads(Path(summary["manifest_uri"]).read_text())
    assert manifest["parent"]["corpus_id"] == first.corpus_id
    assert manifest["delta"]["sources"] == ["AMAZON_FASHION_5.json.gz"]
    assert summary["rows"] == manifest["totals"]["kept"] > manifest["delta"]["totals"]["kept"] > 0
    _, artifacts = asyncio.run(_flow_runs_and_artifacts())
    said = [str(a.data) for a in artifacts if a.key == "corpus-manifest"]
    assert any(f"delta of {manifest['delta']['totals']['kept']:,} rows on corpus" in text for text in said)


def test_settings_come_from_the_environment(cli_env: dict[str, str]) -> None:
    env = {**cli_env, "MLSTM_STORE_URI": "s3://bucket/prefix", "MLSTM_TASK_RUNNER": "thread"}
    shown = json.loads(_cli("settings", env=env).stdout)
    assert shown["resolved_store_uri"] == "s3://bucket/prefix"
    assert shown["task_runner"] == "thread"


@pytest.mark.slow
def test_a_killed_build_leaves_no_manifest_and_resumes(
    cli_env: dict[str, str], amazon_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("reviews_Musical_Instruments_5.json.gz", "Subscription_Boxes.jsonl.gz"):
        (raw / name.removesuffix(".gz")).write_bytes(gzip.decompress((amazon_dir / name).read_bytes()))
    store = tmp_path / "store"
    config = CorpusConfig(split=(98, 1, 1), piece_mb=1)
    plan = plan_corpus([str(raw)], config)
    assert len(plan.pieces) >= 12
    args = ["corpus", "build", str(raw), "--store", str(store), "--split", "98:1:1", "--piece-mb", "1"]
    env = {**cli_env, "MLSTM_TASK_RUNNER": "thread", "MLSTM_MAX_WORKERS": "1"}
    process = subprocess.Popen([CLI, *args], env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    markers = store / plan.prefix / "_work" / "map"
    deadline = time.monotonic() + 120
    while len(list(markers.glob("*/_SUCCESS.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    done_before = {p.parent.name for p in markers.glob("*/_SUCCESS.json")}
    assert 3 <= len(done_before) < len(plan.pieces), "the build was not caught half-way"
    assert not (store / plan.manifest_key).exists()

    # Resume with the plain functions, watching which pieces are read again.
    parsed = parsed_pieces(monkeypatch)
    resumed = build([raw], store, config)
    assert {p.piece_id for p in parsed} == {p.piece_id for p in plan.pieces} - done_before
    clean = build([raw], tmp_path / "clean", config)
    assert resumed.totals == clean.totals
    assert shard_digests(store, resumed) == shard_digests(tmp_path / "clean", clean)


@pytest.mark.long
def test_demo_runs_cleanly_from_nothing(prefect_api_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")  # its own temporary server, as a newcomer gets
    done = subprocess.run([CLI, "demo"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "manifest:" in output and "mlflow ui" in output and "checkpoint:" in output
    for noise in ("Traceback", "Error", "WARNING", "Warning"):
        assert noise not in output, output
    assert list((tmp_path / ".mlstm-sentiment" / "store" / "corpora").glob("*/manifest.json"))


@pytest.mark.parametrize(("name", "package"), [("dask", "prefect-dask"), ("ray", "prefect-ray")])
def test_cluster_task_runners_say_what_to_install(name: str, package: str) -> None:
    import importlib.util

    from flows.runtime import task_runner
    from tasks.settings import Settings

    if importlib.util.find_spec(package.replace("-", "_")) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(RuntimeError, match=f"pip install {package}"):
        task_runner(Settings(task_runner=name))  # type: ignore[arg-type]


def test_local_task_runners_follow_the_settings() -> None:
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    from flows.runtime import task_runner
    from tasks.settings import Settings

    process = task_runner(Settings(task_runner="process", max_workers=3))
    assert isinstance(process, ProcessPoolTaskRunner) and process._max_workers == 3
    assert isinstance(task_runner(Settings(task_runner="thread")), ThreadPoolTaskRunner)
