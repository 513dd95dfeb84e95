"""The store contract, the same for a local folder and for S3 (a moto server on loopback): keys,
listing, atomic publishing, managed multipart uploads, and botocore retries against real faults."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from fault_proxy import FaultProxy

from tasks.store import LocalStore, MiB, S3Store, Store, StoreError, open_store, split_object_uri

S3_PREFIX = "some/prefix"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return S3Store(f"s3://{bucket}/{S3_PREFIX}")


def _tmp_files_on_disk(store: Store) -> list[Path]:
    """Temporary files a writer left anywhere it could have put them."""
    if isinstance(store, LocalStore):
        return sorted(store.root.rglob(".tmp-*")) if store.root.exists() else []
    return []


# ---------------------------------------------------------------------------------------------
# Keys, listing, deleting


def test_write_read_exists(store: Store) -> None:
    assert not store.exists("a/b.bin")
    store.write_bytes("a/b.bin", b"\x00payload\xff")
    assert store.exists("a/b.bin")
    assert store.read_bytes("a/b.bin") == b"\x00payload\xff"
    with store.open_read("a/b.bin") as stream:
        assert stream.read() == b"\x00payload\xff"
    store.write_bytes("a/b.bin", b"replaced")
    assert store.read_bytes("a/b.bin") == b"replaced"
    assert not store.exists("a/b")
    assert not store.exists("a/b.bin.extra")


def test_download_and_put_file(store: Store, tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(b"0123456789" * 1000)
    store.put_file(source, "files/source.bin")
    target = tmp_path / "copy.bin"
    store.download("files/source.bin", target)
    assert target.read_bytes() == source.read_bytes()
    assert source.exists(), "put_file copies; the caller's file stays"


def test_list_is_recursive_sorted_and_relative(store: Store) -> None:
    for key in ("b/2.txt", "a/sub/deep/3.txt", "a/1.txt", "ab/4.txt", "c.txt"):
        store.write_bytes(key, key.encode())
    everything = ["a/1.txt", "a/sub/deep/3.txt", "ab/4.txt", "b/2.txt", "c.txt"]
    assert store.list("") == everything
    # A prefix is a folder (or one key), as on disk: "a" does not reach into "ab/".
    assert store.list("a") == ["a/1.txt", "a/sub/deep/3.txt"]
    assert store.list("a/") == ["a/1.txt", "a/sub/deep/3.txt"]
    assert store.list("a/sub") == ["a/sub/deep/3.txt"]
    assert store.list("c.txt") == ["c.txt"]
    assert store.list("missing") == []
    assert store.list("c") == []


def test_s3_list_stays_inside_the_store_root(s3_bucket: str) -> None:
    import boto3

    client = boto3.client("s3")
    client.put_object(Bucket=s3_bucket, Key=f"{S3_PREFIX}2/outside.txt", Body=b"x")
    client.put_object(Bucket=s3_bucket, Key="top.txt", Body=b"x")
    store = S3Store(f"s3://{s3_bucket}/{S3_PREFIX}/")
    store.write_bytes("inside.txt", b"y")
    assert store.list("") == ["inside.txt"]
    assert S3Store(f"s3://{s3_bucket}").list("") == sorted(
        [f"{S3_PREFIX}/inside.txt", f"{S3_PREFIX}2/outside.txt", "top.txt"]
    )


def test_delete_prefix(store: Store) -> None:
    for key in ("run/_work/map/1.arrow", "run/_work/map/2.arrow", "run/_work2/keep.txt", "run/keep.json"):
        store.write_bytes(key, b"x")
    store.delete_prefix("run/_work")
    assert store.list("") == ["run/_work2/keep.txt", "run/keep.json"]
    store.delete_prefix("run/keep.json")
    assert store.list("") == ["run/_work2/keep.txt"]
    store.delete_prefix("never/written")  # nothing to delete is not an error
    assert store.list("") == ["run/_work2/keep.txt"]


def test_s3_delete_prefix_reports_failed_deletions(s3_bucket: str) -> None:
    """DeleteObjects answers 200 even when keys fail; the failures are in the body."""
    from botocore.stub import Stubber

    store = S3Store(f"s3://{s3_bucket}/{S3_PREFIX}")
    with Stubber(store.client) as stub:
        stub.add_response(
            "list_objects_v2",
            {"Contents": [{"Key": f"{S3_PREFIX}/x/1"}, {"Key": f"{S3_PREFIX}/x/2"}], "IsTruncated": False},
        )
        stub.add_response(
            "delete_objects",
            {"Errors": [{"Key": f"{S3_PREFIX}/x/2", "Code": "AccessDenied", "Message": "Access Denied"}]},
        )
        with pytest.raises(StoreError, match=r"AccessDenied"):
            store.delete_prefix("x")


def test_url(store: Store) -> None:
    if isinstance(store, LocalStore):
        assert store.url("corpora/x/manifest.json") == f"{store.root}/corpora/x/manifest.json"
    else:
        assert isinstance(store, S3Store)
        assert store.url("corpora/x/manifest.json") == (
            f"s3://{store.bucket}/{S3_PREFIX}/corpora/x/manifest.json"
        )
    assert store.url("/k") == store.url("k")


def test_local_store_publishes_with_the_usual_file_mode(tmp_path: Path) -> None:
    """Temporary files are 0600; a published file is readable like any file the user writes."""
    store = LocalStore(tmp_path / "store")
    store.write_bytes("shared/file.bin", b"x")
    umask = os.umask(0o022)
    os.umask(umask)
    assert (store.root / "shared/file.bin").stat().st_mode & 0o777 == 0o666 & ~umask


# ---------------------------------------------------------------------------------------------
# open_store and split_object_uri


def test_open_store_kinds(tmp_path: Path, s3_bucket: str) -> None:
    folder = tmp_path / "a store"  # the space is percent-encoded in the file:// URI
    plain = open_store(str(folder))
    assert isinstance(plain, LocalStore)
    assert plain.root == folder.resolve()
    as_uri = open_store(folder.as_uri())
    assert isinstance(as_uri, LocalStore)
    assert as_uri.root == folder.resolve()
    as_uri.write_bytes("k", b"v")
    assert plain.read_bytes("k") == b"v"
    s3 = open_store(f"s3://{s3_bucket}/{S3_PREFIX}/", max_attempts=4)
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.uri) == (s3_bucket, S3_PREFIX, f"s3://{s3_bucket}/{S3_PREFIX}")
    assert s3.max_attempts == 4
    assert isinstance(open_store(f"s3://{s3_bucket}"), S3Store)


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("gs://x/prefix", r"unsupported store URI 'gs://x/prefix'"),
        ("ftp://host/x", r"unsupported store URI"),
        ("s3://", r"has no bucket"),
        ("s3:///only/a/prefix", r"has no bucket"),
        ("file://otherhost/x", r"names a host"),
    ],
)
def test_open_store_rejects(uri: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(uri)


def test_split_object_uri(store: Store) -> None:
    store.write_bytes("corpora/abc/manifest.json", b"{}")
    uri = store.url("corpora/abc/manifest.json")
    folder, key = split_object_uri(uri)
    assert key == "manifest.json"
    assert type(folder) is type(store)
    assert folder.uri == store.url("corpora/abc")
    assert folder.read_bytes(key) == b"{}"
    if isinstance(store, S3Store):
        assert isinstance(folder, S3Store)
        assert (folder.bucket, folder.prefix) == (store.bucket, f"{S3_PREFIX}/corpora/abc")


@pytest.mark.parametrize("uri", ["s3://bucket", "s3://bucket/", "/"])
def test_split_object_uri_needs_an_object(uri: str) -> None:
    with pytest.raises(StoreError, match="does not name an object"):
        split_object_uri(uri)


def test_a_bare_file_name_is_an_object_in_the_working_folder() -> None:
    store, key = split_object_uri("manifest.json")
    assert isinstance(store, LocalStore) and store.url(key) == str(Path("manifest.json").resolve())


# ---------------------------------------------------------------------------------------------
# Atomic publishing


def test_writer_publishes_only_on_exit(store: Store) -> None:
    store.write_bytes("out/other.txt", b"already there")
    with store.writer("out/shard.arrow") as path:
        path.write_bytes(b"complete file")
        assert path.read_bytes() == b"complete file"
        assert not store.exists("out/shard.arrow")
        assert store.list("out") == ["out/other.txt"]
        assert store.list("") == ["out/other.txt"]
        if isinstance(store, LocalStore):
            # The temporary file lies beside its target (one rename), but no reader sees it.
            assert path.parent == store.root / "out"
    assert store.exists("out/shard.arrow")
    assert store.read_bytes("out/shard.arrow") == b"complete file"
    assert store.list("out") == ["out/other.txt", "out/shard.arrow"]
    assert not path.exists()
    assert _tmp_files_on_disk(store) == []


def test_writer_discards_on_error(store: Store) -> None:
    class Boom(Exception):
        pass

    store.write_bytes("out/other.txt", b"x")
    with pytest.raises(Boom), store.writer("out/shard.arrow") as path:
        path.write_bytes(b"half a file")
        raise Boom
    assert not store.exists("out/shard.arrow")
    assert store.list("") == ["out/other.txt"]
    assert not path.exists()
    assert _tmp_files_on_disk(store) == []
    if isinstance(store, LocalStore):
        assert sorted(p.name for p in (store.root / "out").iterdir()) == ["other.txt"]


def test_writer_keeps_the_old_version_on_error(store: Store) -> None:
    store.write_bytes("latest.json", b"old")
    with pytest.raises(RuntimeError), store.writer("latest.json") as path:
        path.write_bytes(b"new but unfinished")
        raise RuntimeError("interrupted")
    assert store.read_bytes("latest.json") == b"old"
    assert _tmp_files_on_disk(store) == []


# ---------------------------------------------------------------------------------------------
# S3: managed multipart upload


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(8 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.mark.slow
def test_s3_put_file_above_threshold_is_multipart(s3_bucket: str, tmp_path: Path) -> None:
    import boto3

    big = tmp_path / "big.bin"
    with big.open("wb") as stream:
        for _ in range(7):
            stream.write(os.urandom(10 * MiB))  # 70 MiB: above the 64 MiB threshold
    store = S3Store(f"s3://{s3_bucket}/{S3_PREFIX}")
    store.put_file(big, "shards/big.bin")
    head = boto3.client("s3").head_object(Bucket=s3_bucket, Key=f"{S3_PREFIX}/shards/big.bin")
    assert re.fullmatch(r'"[0-9a-f]{32}-2"', head["ETag"]), head["ETag"]  # 64 MiB + 6 MiB
    assert head["ContentLength"] == 70 * MiB
    copy = tmp_path / "copy.bin"
    store.download("shards/big.bin", copy)
    assert _sha256_file(copy) == _sha256_file(big)
    # A small file is one plain PUT: its ETag is the MD5 alone.
    store.write_bytes("shards/small.bin", b"small")
    small = boto3.client("s3").head_object(Bucket=s3_bucket, Key=f"{S3_PREFIX}/shards/small.bin")
    assert small["ETag"] == f'"{hashlib.md5(b"small").hexdigest()}"'


def test_an_s3_download_tells_its_progress_in_the_caller_s_thread(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boto3 tells a transfer's Callback from its own threads, where the caller's context (a Prefect
    run's, which a progress artifact needs) is not: the bytes so far are told in the calling thread,
    growing to the object's size."""
    import threading

    import tasks.store

    monkeypatch.setattr(tasks.store, "REPORT_SECONDS", 0.001)
    data = os.urandom(8 * MiB)
    store = S3Store(f"s3://{s3_bucket}/{S3_PREFIX}")
    store.write_bytes("big.bin", data)
    told: list[tuple[int, int, int]] = []
    copy = tmp_path / "copy.bin"
    store.download(
        "big.bin", copy, on_read=lambda done, size: told.append((threading.get_ident(), done, size))
    )
    assert copy.read_bytes() == data
    assert {thread for thread, _, _ in told} == {threading.get_ident()}
    assert told[-1][1:] == (len(data), len(data))
    assert [done for _, done, _ in told] == sorted(done for _, done, _ in told)


# ---------------------------------------------------------------------------------------------
# S3: retries


def test_s3_client_retries_adaptively(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for attempts in (1, 10):
        store = S3Store(f"s3://{s3_bucket}", max_attempts=attempts)
        retries = store.client.meta.config.retries
        assert retries["mode"] == "adaptive"
        # botocore keeps the total (first try included) whichever key it was given.
        assert retries["total_max_attempts"] == attempts
    assert open_store(f"s3://{s3_bucket}").max_attempts == 10  # type: ignore[attr-defined]
    # The setting reaches stores made without it (sources, manifests named by URI).
    monkeypatch.setenv("MLSTM_S3_MAX_ATTEMPTS", "3")
    assert open_store(f"s3://{s3_bucket}").max_attempts == 3  # type: ignore[attr-defined]
    assert S3Store(f"s3://{s3_bucket}", max_attempts=5).max_attempts == 5


@pytest.mark.slow
def test_s3_store_rides_out_throttling_and_server_errors(
    s3_bucket: str, fault_proxy: Callable[..., FaultProxy]
) -> None:
    """Real 503 SlowDown / 500 InternalError answers on the wire: the store's calls still succeed."""
    # Request numbers that fail: the PUT twice, then the first try of the GET and of the LIST.
    schedule = {
        0: (503, "SlowDown"),
        1: (500, "InternalError"),
        3: (503, "ServiceUnavailable"),
        5: (500, "InternalError"),
    }
    proxy = fault_proxy(lambda number, method, path: schedule.get(number))
    store = S3Store(f"s3://{s3_bucket}/{S3_PREFIX}", endpoint_url=proxy.url, max_attempts=5)

    store.write_bytes("retried/object.bin", b"made it through")
    assert store.read_bytes("retried/object.bin") == b"made it through"
    assert store.list("retried") == ["retried/object.bin"]

    assert [status for _, _, status in proxy.seen] == [503, 500, 200, 503, 200, 500, 200]
    assert len(proxy.failed()) == 4
    methods = [method for method, _, _ in proxy.seen]
    assert methods == ["PUT", "PUT", "PUT", "GET", "GET", "GET", "GET"]
    # What went through the proxy really reached the S3 server.
    direct = S3Store(f"s3://{s3_bucket}/{S3_PREFIX}")
    assert direct.read_bytes("retried/object.bin") == b"made it through"


@pytest.mark.slow
def test_s3_store_gives_up_after_max_attempts(s3_bucket: str, fault_proxy: Callable[..., FaultProxy]) -> None:
    """A server that always fails gets exactly max_attempts tries, then the error surfaces."""
    from botocore.exceptions import ClientError

    S3Store(f"s3://{s3_bucket}").write_bytes("object.bin", b"x")
    proxy = fault_proxy(lambda number, method, path: (500, "InternalError"))
    store = S3Store(f"s3://{s3_bucket}", endpoint_url=proxy.url, max_attempts=3)
    with pytest.raises(ClientError, match="InternalError"):
        store.read_bytes("object.bin")
    assert len(proxy.seen) == 3
    assert all(status == 500 for _, _, status in proxy.seen)


def test_create_writes_only_where_nothing_is(store: Store) -> None:
    """A lock's claim: the first create wins, the second is refused and leaves the first's bytes."""
    assert store.create("corpora/abc/_lock.json", b"first")
    assert not store.create("corpora/abc/_lock.json", b"second")
    assert store.read_bytes("corpora/abc/_lock.json") == b"first"
