"""Faults a production user meets, against real parts: an object store that throttles and fails
requests (real S3 error answers from a proxy in front of the moto server) under the CLI's corpus
build, and an outage that outlasts the retries. The build either finishes with the same bytes as a
build that met no fault, or fails cleanly with nothing half-published, and a rerun finishes it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy, fail_after_puts, never, proxies, random_faults

from tasks.corpus.build import CorpusConfig, build_in_process, plan_corpus
from tasks.store import S3Store

CLI = str(Path(sys.executable).parent / "mlstm-sentiment")
SPLIT = CorpusConfig(split=(18, 1, 1))
NUM_SEEDS = 4  # 4 generated samples × 3 release formats = 12 sources, so 12 pieces to parse


@pytest.fixture(scope="module")
def raw_sources(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bucket with 12 small generated review files under raw/; yields the bucket's name."""
    import boto3

    from tasks.corpus.sample import write_sample

    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("fault-sources")
    for seed in range(NUM_SEEDS):
        for path in write_sample(root / f"seed-{seed}", num_reviews=600, seed=seed):
            client.upload_file(str(path), bucket, f"raw/seed-{seed}/{path.name}")
    yield bucket


@pytest.fixture(scope="module")
def clean_build(raw_sources: str) -> dict[str, Any]:
    """The same sources built straight into the moto server (no proxy, no fault), with the plain
    functions: the bytes every faulty build must end up with."""
    plan = plan_corpus([f"s3://{raw_sources}/raw/"], SPLIT)
    manifest = build_in_process(plan, S3Store(f"s3://{raw_sources}/clean"))
    assert len(plan.pieces) == 3 * NUM_SEEDS
    return manifest.model_dump(by_alias=True)  # as the JSON on disk


def _objects(bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` (keys relative to it), read straight from the moto server."""
    import boto3

    client = boto3.client("s3")
    keys = [
        item["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for item in page.get("Contents", [])
    ]
    return {
        k.removeprefix(prefix + "/"): client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys
    }


def _comparable(objects: dict[str, bytes], store_uri: str) -> dict[str, bytes]:
    """The objects as a build elsewhere would have written them: the manifest names its own store
    and the time it was written; everything else must be the same bytes."""
    manifests = [k for k in objects if k.endswith("/manifest.json")]
    assert len(manifests) == 1, sorted(objects)
    text = objects[manifests[0]].replace(store_uri.encode(), b"<store>")
    text, num_stamps = re.subn(rb'"created_at": "[^"]+"', b'"created_at": "<time>"', text)
    assert num_stamps == 1
    return {**objects, manifests[0]: text}


def _check_same_as_clean(bucket: str, prefix: str, clean: dict[str, Any]) -> None:
    built = _objects(bucket, prefix)
    assert not [k for k in built if "/_work/" in k], "work files are dropped once the manifest is out"
    expected = _objects(bucket, "clean")
    assert sorted(built) == sorted(expected)
    assert _comparable(built, f"s3://{bucket}/{prefix}") == _comparable(expected, f"s3://{bucket}/clean")
    shards = [s["path"] for split in clean["splits"].values() for s in split["shards"]]
    assert len(shards) >= 3 and all(f"corpora/{clean['corpus_id']}/{p}" in built for p in shards)


def _build(
    bucket: str, prefix: str, home: Path, proxy: FaultProxy, **env: str
) -> subprocess.CompletedProcess[str]:
    """``mlstm-sentiment corpus build`` from the bucket's raw/ into s3://bucket/prefix, every S3 call
    through the proxy (boto3's own endpoint points nowhere, so a call that bypassed it would fail)."""
    args = ["corpus", "build", f"s3://{bucket}/raw/", "--store", f"s3://{bucket}/{prefix}"]
    args += ["--split", "18:1:1", "--json"]
    environ = {
        **os.environ,
        "MLSTM_HOME": str(home),
        "MLSTM_S3_ENDPOINT_URL": proxy.url,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "COLUMNS": "200",
        **env,
    }
    return subprocess.run([CLI, *args], env=environ, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_throttling_and_server_errors_are_ridden_out_with_the_same_bytes(
    prefect_api_url: str,
    home: Path,
    raw_sources: str,
    clean_build: dict[str, Any],
    fault_proxy: Callable[..., FaultProxy],
) -> None:
    """A fifth of all S3 requests answered 503 SlowDown / 503 ServiceUnavailable / 500 InternalError:
    the build finishes, and publishes exactly what a build that met no fault published."""
    proxy = fault_proxy(random_faults(0.2, seed=7))
    done = _build(raw_sources, "flaky", home, proxy)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["corpus_id"] == clean_build["corpus_id"]
    assert (
        summary["manifest_uri"]
        == f"s3://{raw_sources}/flaky/corpora/{clean_build['corpus_id']}/manifest.json"
    )
    assert summary["rows"] == clean_build["totals"]["kept"]

    failed = proxy.failed()
    assert len(failed) >= 20, f"{len(failed)} of {len(proxy.seen)} requests failed"
    assert 0.1 <= len(failed) / len(proxy.seen) <= 0.35
    # Every kind of call met faults: listing and reading sources, probing markers, publishing.
    assert {"GET", "HEAD", "PUT"} <= {method for method, _, _ in failed}
    assert {status for _, _, status in failed} == {500, 503}
    _check_same_as_clean(raw_sources, "flaky", clean_build)


@dataclass
class Outage:
    """A corpus build that met an outage it could not ride out, then the same command once the store
    was back."""

    failed: subprocess.CompletedProcess[str]
    seconds: float
    num_failed_requests: int
    left: dict[str, bytes]  # what the failed build left under its store
    rerun: subprocess.CompletedProcess[str]
    rerun_markers: set[str]  # pieces whose completion marker the rerun wrote


@pytest.fixture(scope="module")
def outage(
    prefect_api_url: str, s3_server: str, raw_sources: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Outage]:
    """The store fails every request after the first 20 PUTs, with 2 attempts per call: longer than
    botocore's and Prefect's retries last."""
    home = tmp_path_factory.mktemp("outage") / "home"
    with proxies(s3_server) as start:
        proxy = start(fail_after_puts(20))
        started = time.perf_counter()
        failed = _build(raw_sources, "outage", home, proxy, MLSTM_S3_MAX_ATTEMPTS="2")
        seconds = time.perf_counter() - started
        num_failed_requests = len(proxy.failed())
        left = _objects(raw_sources, "outage")
        proxy.fault = never
        proxy.seen.clear()
        rerun = _build(raw_sources, "outage", home, proxy, MLSTM_S3_MAX_ATTEMPTS="2")
        markers = {
            path.split("/")[-2]
            for method, path, _ in proxy.seen
            if method == "PUT" and "_SUCCESS.json" in path
        }
    yield Outage(failed, seconds, num_failed_requests, left, rerun, markers)


@pytest.mark.long  # the outage's retries: about 95 s; the throttling test keeps the fault path in make test
def test_an_outage_mid_build_publishes_nothing_and_a_rerun_finishes(
    outage: Outage, raw_sources: str, clean_build: dict[str, Any]
) -> None:
    """The command fails, no manifest is published; once the store is back, the same command
    finishes the corpus, without parsing again the pieces done before the outage."""
    assert outage.failed.returncode != 0
    assert outage.failed.stdout.strip() == ""
    assert outage.num_failed_requests > 0
    assert not [k for k in outage.left if k.endswith("manifest.json")], sorted(outage.left)
    shards = [k for k in outage.left if k.split("/")[2] in ("train", "val", "test")]
    assert shards == [], "no shard is written before every piece is parsed"
    done_before = {k.split("/")[4] for k in outage.left if k.endswith("/_SUCCESS.json")}
    assert 1 <= len(done_before) < 3 * NUM_SEEDS, sorted(outage.left)

    assert outage.rerun.returncode == 0, outage.rerun.stderr
    assert json.loads(outage.rerun.stdout)["corpus_id"] == clean_build["corpus_id"]
    assert not outage.rerun_markers & done_before, "pieces finished before the outage are not parsed again"
    assert len(outage.rerun_markers) == 3 * NUM_SEEDS - len(done_before)
    _check_same_as_clean(raw_sources, "outage", clean_build)


@pytest.mark.long  # shares the outage above
def test_an_outage_is_one_line_on_stderr(outage: Outage) -> None:
    stderr = outage.failed.stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert "ServiceUnavailable" in errors[0] or "503" in errors[0], errors[0]
    assert "after 2 attempts per call" in errors[0] and "MLSTM_S3_MAX_ATTEMPTS" in errors[0], errors[0]
