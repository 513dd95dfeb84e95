"""Sources that are not local files: s3:// prefixes and objects on a moto server, http:// URLs on a
loopback server, all holding the real shared review files; then the corpus flow and the CLI on them."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pytest
from corpus_helpers import SUMMARY_KEYS

from tasks.corpus.build import CorpusConfig
from tasks.corpus.sources import SourceError, expand_sources, fingerprint, iter_blocks, pieces_of
from tasks.store import MiB

SMALL_SPLIT = CorpusConfig(split=(98, 1, 1))
CLI = str(Path(sys.executable).parent / "mlstm-sentiment")
# Small real files (README §3a): name → lines (every line is one record). The http:// file sorts
# first both by URL and by name, so remote and local builds number the sources alike (see
# test_source_numbering_does_not_depend_on_location for what happens otherwise).
S3_FILES = {
    "Appliances_5.json.gz": 2277,
    "Gift_Cards_5.json.gz": 2972,
    "Magazine_Subscriptions_5.json.gz": 2375,
}
HTTP_FILE = ("AMAZON_FASHION_5.json.gz", 3176)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def raw_bucket(s3_bucket: str, amazon_dir: Path) -> str:
    """A bucket with three review files under raw/, plus files that are not reviews."""
    import boto3

    client = boto3.client("s3")
    for name in S3_FILES:
        client.upload_file(str(amazon_dir / name), s3_bucket, f"raw/{name}")
    client.put_object(Bucket=s3_bucket, Key="raw/README.txt", Body=b"not reviews")
    client.put_object(Bucket=s3_bucket, Key="docs/README.txt", Body=b"not reviews")
    client.put_object(Bucket=s3_bucket, Key="exports/2024-01-01", Body=b'{"reviewText": "x"}\n')
    return s3_bucket


@pytest.fixture
def served(http_root: tuple[str, Path], amazon_dir: Path) -> Iterator[tuple[str, Path]]:
    """(URL, local file) of a real review file served over HTTP (linked, never copied)."""
    base, root = http_root
    folder = root / uuid.uuid4().hex[:8]
    folder.mkdir()
    (folder / HTTP_FILE[0]).symlink_to(amazon_dir / HTTP_FILE[0])
    yield f"{base}/{folder.name}/{HTTP_FILE[0]}", amazon_dir / HTTP_FILE[0]
    shutil.rmtree(folder)


class _GzipEncodingHandler(http.server.SimpleHTTPRequestHandler):
    """Labels .gz files "Content-Encoding: gzip", as Apache's AddEncoding and many S3 uploads do."""

    def end_headers(self) -> None:
        if self.path.split("?")[0].endswith(".gz"):
            self.send_header("Content-Encoding", "gzip")
        super().end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def gzip_encoding_server(amazon_dir: Path) -> Iterator[str]:
    handler = functools.partial(_GzipEncodingHandler, directory=str(amazon_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# ---------------------------------------------------------------------------------------------
# expand_sources


def test_s3_prefix_expands_to_its_review_files(raw_bucket: str) -> None:
    expected = [f"s3://{raw_bucket}/raw/{name}" for name in sorted(S3_FILES)]
    assert expand_sources([f"s3://{raw_bucket}/raw/"]) == expected
    assert expand_sources([f"s3://{raw_bucket}/raw"]) == expected


def test_s3_object_is_taken_as_named(raw_bucket: str) -> None:
    uri = f"s3://{raw_bucket}/raw/Appliances_5.json.gz"
    assert expand_sources([uri]) == [uri]
    # Like a local file named on the command line, an exact object needs no review suffix.
    exact = f"s3://{raw_bucket}/exports/2024-01-01"
    assert expand_sources([exact]) == [exact]


@pytest.mark.parametrize("prefix", ["docs/", "nothing/", "raw/README"])
def test_s3_prefix_without_review_files_is_an_error(raw_bucket: str, prefix: str) -> None:
    uri = f"s3://{raw_bucket}/{prefix}"
    with pytest.raises(SourceError, match="no review files") as error:
        expand_sources([uri])
    assert repr(uri) in str(error.value)


def test_s3_missing_bucket_is_an_error(s3_server: str) -> None:
    uri = "s3://no-such-bucket-here/raw/"
    with pytest.raises(SourceError, match="cannot be listed") as error:
        expand_sources([uri])
    assert repr(uri) in str(error.value)


def test_http_url_is_accepted(served: tuple[str, Path]) -> None:
    url, _ = served
    assert expand_sources([url]) == [url]


class _CountingHandler(http.server.BaseHTTPRequestHandler):
    """A plain-HTTP server that counts the connections it is handed (a TLS hello arrives as a bad request)."""

    seen: ClassVar[list[str]] = []

    def handle_one_request(self) -> None:
        type(self).seen.append(self.client_address[0])
        super().handle_one_request()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_an_https_url_on_a_plain_http_server_is_one_line_and_one_try() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}/reviews.json.gz"
        with pytest.raises(SourceError) as raised:
            expand_sources([url])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert str(raised.value) == (
        f"SOURCE {url!r}: the TLS handshake failed (WRONG_VERSION_NUMBER); if the server speaks plain HTTP, "
        "write http://"
    )
    assert len(_CountingHandler.seen) == 1  # not retried: the same handshake would fail again


def test_http_404_is_an_error(http_root: tuple[str, Path]) -> None:
    url = f"{http_root[0]}/missing/{uuid.uuid4().hex}.json.gz"
    with pytest.raises(SourceError, match="HTTP 404") as error:
        expand_sources([url])
    assert repr(url) in str(error.value)


def test_local_problems_name_the_argument(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json.gz"
    with pytest.raises(SourceError, match="no such file") as error:
        expand_sources([str(missing)])
    assert str(missing) in str(error.value)

    folder = tmp_path / "no-reviews"
    folder.mkdir()
    (folder / "notes.txt").write_text("not reviews")
    with pytest.raises(SourceError, match="holds no review files") as error:
        expand_sources([str(folder)])
    assert repr(str(folder)) in str(error.value)

    pattern = str(tmp_path / "*.jsonl.gz")
    with pytest.raises(SourceError, match="matches no file") as error:
        expand_sources([pattern])
    assert repr(pattern) in str(error.value)

    with pytest.raises(SourceError, match="no SOURCE"):
        expand_sources([])


def test_a_mix_of_every_kind(raw_bucket: str, served: tuple[str, Path], amazon_dir: Path) -> None:
    url, _ = served
    partial = amazon_dir / "partial" / "2014"
    args = [
        f"s3://{raw_bucket}/raw/",
        f"s3://{raw_bucket}/raw/Gift_Cards_5.json.gz",  # also under the prefix: listed once
        url,
        str(amazon_dir / "Subscription_Boxes.jsonl.gz"),
        str(partial),
        str(amazon_dir / "All_*.json.gz"),
    ]
    expected = sorted(
        [f"s3://{raw_bucket}/raw/{name}" for name in S3_FILES]
        + [url, str((amazon_dir / "Subscription_Boxes.jsonl.gz").resolve())]
        + [str(p.resolve()) for p in partial.glob("*.json.gz")]
        + [str((amazon_dir / "All_Beauty_5.json.gz").resolve())]
    )
    assert expand_sources(args) == expected
    assert len(expected) == 3 + 1 + 1 + 3 + 1
    assert len(set(expected)) == len(expected)


# ---------------------------------------------------------------------------------------------
# fingerprint and streaming


def test_fingerprint_of_remote_sources_is_the_files_sha256(
    raw_bucket: str, served: tuple[str, Path], amazon_dir: Path
) -> None:
    local = amazon_dir / "Appliances_5.json.gz"
    s3 = fingerprint(f"s3://{raw_bucket}/raw/Appliances_5.json.gz", piece_bytes=MiB)
    assert s3.sha256 == _sha256(local.read_bytes())
    assert s3.size == local.stat().st_size == 72998
    assert (s3.name, s3.category, s3.gzip) == ("Appliances_5.json.gz", "Appliances", True)
    assert s3.piece_starts == ((0, 1),)  # a gzip file is one piece

    url, path = served
    web = fingerprint(url, piece_bytes=MiB)
    assert web.sha256 == _sha256(path.read_bytes())
    assert web.size == path.stat().st_size == 287013
    assert (web.name, web.category, web.gzip) == (HTTP_FILE[0], "AMAZON_FASHION", True)


def test_fingerprint_of_a_url_with_a_query(served: tuple[str, Path]) -> None:
    """A presigned URL: the name (and the category, and the corpus id) come from the path."""
    url, path = served
    signed = fingerprint(f"{url}?X-Amz-Signature=abc123&X-Amz-Expires=600", piece_bytes=MiB)
    assert signed.name == HTTP_FILE[0]
    assert signed.category == "AMAZON_FASHION"
    assert signed.sha256 == _sha256(path.read_bytes())


def test_fingerprint_ignores_content_encoding(gzip_encoding_server: str, amazon_dir: Path) -> None:
    """A server that labels a .gz "Content-Encoding: gzip" still delivers the file's own bytes."""
    local = amazon_dir / "Appliances_5.json.gz"
    source = fingerprint(f"{gzip_encoding_server}/Appliances_5.json.gz", piece_bytes=MiB)
    assert source.sha256 == _sha256(local.read_bytes())
    assert source.size == local.stat().st_size
    assert source.gzip
    (piece,) = pieces_of(0, source)
    data = b"".join(b.data for b in iter_blocks(piece, block_bytes=MiB))
    assert data == gzip.decompress(local.read_bytes())


def test_remote_blocks_are_the_decompressed_lines(
    raw_bucket: str, served: tuple[str, Path], amazon_dir: Path
) -> None:
    for uri, local in [
        (f"s3://{raw_bucket}/raw/Gift_Cards_5.json.gz", amazon_dir / "Gift_Cards_5.json.gz"),
        served,
    ]:
        (piece,) = pieces_of(0, fingerprint(uri, piece_bytes=MiB))
        blocks = list(iter_blocks(piece, block_bytes=64 * 1024))
        assert len(blocks) > 1
        assert all(b.damaged is None and b.data.endswith(b"\n") for b in blocks)
        assert b"".join(b.data for b in blocks) == gzip.decompress(local.read_bytes())
        assert blocks[0].first_line == 1
        for before, after in itertools.pairwise(blocks):
            assert after.first_line == before.first_line + before.data.count(b"\n")


def test_truncated_s3_object_ends_in_a_damaged_block(s3_bucket: str, amazon_dir: Path) -> None:
    import boto3

    whole = (amazon_dir / "Appliances_5.json.gz").read_bytes()
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="cut/Appliances_5.json.gz", Body=whole[:40000])
    (piece,) = pieces_of(0, fingerprint(f"s3://{s3_bucket}/cut/Appliances_5.json.gz", piece_bytes=MiB))
    blocks = list(iter_blocks(piece, block_bytes=64 * 1024))
    assert blocks[-1].damaged is not None and "truncated" in blocks[-1].damaged
    assert all(b.damaged is None for b in blocks[:-1])
    delivered = b"".join(b.data for b in blocks)
    assert gzip.decompress(whole).startswith(delivered)
    assert delivered.count(b"\n") > 100


def test_a_plain_s3_object_is_read_in_pieces_by_ranged_gets(
    s3_bucket: str, amazon_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large plain object parses in parallel as a local file does: the same line-aligned pieces, each
    read from its own start by a ranged GET (not the object from its start), and the same shards."""
    import boto3
    from corpus_helpers import build, shard_digests

    from tasks.store import S3Store

    plain = gzip.decompress((amazon_dir / "reviews_Musical_Instruments_5.json.gz").read_bytes())
    local = tmp_path / "reviews_Musical_Instruments_5.json"
    local.write_bytes(plain)
    boto3.client("s3").put_object(Bucket=s3_bucket, Key=f"plain/{local.name}", Body=plain)
    uri = f"s3://{s3_bucket}/plain/{local.name}"
    remote, here = fingerprint(uri, piece_bytes=MiB), fingerprint(str(local), piece_bytes=MiB)
    assert remote.piece_starts == here.piece_starts and len(remote.piece_starts) >= 4

    starts: list[int] = []
    open_read = S3Store.open_read
    monkeypatch.setattr(
        S3Store,
        "open_read",
        lambda self, key, start=0: starts.append(start) or open_read(self, key, start=start),
    )
    pieces = pieces_of(0, remote)
    blocks = [list(iter_blocks(piece, block_bytes=64 * 1024)) for piece in pieces]
    assert starts == [offset for offset, _ in here.piece_starts]
    assert b"".join(block.data for piece in blocks for block in piece) == plain
    assert [piece[0].first_line for piece in blocks] == [line for _, line in here.piece_starts]

    config = SMALL_SPLIT.model_copy(update={"piece_mb": 1, "block_mb": 1})
    from_s3, from_disk = build([uri], tmp_path / "a", config), build([local], tmp_path / "b", config)
    assert from_s3.totals == from_disk.totals
    assert shard_digests(tmp_path / "a", from_s3) == shard_digests(tmp_path / "b", from_disk)


# ---------------------------------------------------------------------------------------------
# The corpus flow and the CLI on S3


def _s3_objects(bucket: str, prefix: str) -> dict[str, bytes]:
    import boto3

    client = boto3.client("s3")
    keys = [
        item["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for item in page.get("Contents", [])
    ]
    return {key: client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}


def _check_published(bucket: str, summary: dict[str, Any]) -> dict[str, Any]:
    """The manifest and every shard it lists are in the bucket, as the manifest says."""
    assert set(summary) == SUMMARY_KEYS
    corpus = f"store/corpora/{summary['corpus_id']}"
    assert summary["manifest_uri"] == f"s3://{bucket}/{corpus}/manifest.json"
    objects = _s3_objects(bucket, corpus + "/")
    manifest = json.loads(objects[f"{corpus}/manifest.json"])
    assert manifest["corpus_id"] == summary["corpus_id"]
    assert manifest["uri"] == f"s3://{bucket}/{corpus}"
    listed = {f"{corpus}/manifest.json"}
    rows = 0
    for split in manifest["splits"].values():
        assert split["rows"] == sum(s["rows"] for s in split["shards"])
        for shard in split["shards"]:
            data = objects[f"{corpus}/{shard['path']}"]
            assert _sha256(data) == shard["sha256"]
            assert len(data) == shard["bytes"]
            assert pa.ipc.open_file(pa.BufferReader(data)).read_all().num_rows == shard["rows"]
            listed.add(f"{corpus}/{shard['path']}")
            rows += shard["rows"]
    for uri in manifest["rejected_files"]:
        assert uri.startswith(f"s3://{bucket}/{corpus}/rejected/")
        listed.add(uri.removeprefix(f"s3://{bucket}/"))
    for keys in manifest["keys"]:  # the key index a delta on this corpus reads
        assert _sha256(objects[f"{corpus}/{keys['path']}"]) == keys["sha256"]
        listed.add(f"{corpus}/{keys['path']}")
    # Nothing else: the _work/ staging prefix is gone.
    assert not [k for k in objects if "/_work/" in k]
    assert set(objects) == listed
    totals = manifest["totals"]
    assert rows == summary["rows"] == totals["kept"]
    assert (summary["duplicates"], summary["rejected"]) == (totals["duplicates"], totals["rejected"])
    for source in manifest["sources"]:
        assert source["records"] == source["kept"] + source["duplicates"] + source["rejected"]
    for key in ("records", "kept", "duplicates", "rejected"):
        assert totals[key] == sum(s[key] for s in manifest["sources"])
    return manifest


def _shard_digests(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return [(s["path"], s["sha256"]) for split in manifest["splits"].values() for s in split["shards"]]


@pytest.mark.slow
def test_flow_builds_from_s3_and_http_into_s3(
    prefect_api_url: str,
    home: Path,
    raw_bucket: str,
    served: tuple[str, Path],
    amazon_dir: Path,
    tmp_path: Path,
) -> None:
    from flows.cli.corpus import run_corpus_build

    url, _ = served
    summary = run_corpus_build(
        [f"s3://{raw_bucket}/raw/", url],
        store=f"s3://{raw_bucket}/store",
        config=SMALL_SPLIT,
        show_progress=False,
    ).model_dump()
    manifest = _check_published(raw_bucket, summary)
    by_name = {s["name"]: s for s in manifest["sources"]}
    assert set(by_name) == {*S3_FILES, HTTP_FILE[0]}
    assert by_name[HTTP_FILE[0]]["uri"] == url
    for name, lines in [*S3_FILES.items(), HTTP_FILE]:
        source = by_name[name]
        assert source["records"] == lines
        assert source["sha256"] == _sha256((amazon_dir / name).read_bytes())
        if name in S3_FILES:
            assert source["uri"] == f"s3://{raw_bucket}/raw/{name}"
    assert by_name["Appliances_5.json.gz"]["duplicates"] >= 2074  # README §3a
    assert summary["rejected"] > 0  # reviews without text (README §3a)
    assert all(uri.startswith("s3://") for uri in manifest["rejected_files"])

    # The same files from their local copies, into a local store: the same corpus, byte for byte.
    local = run_corpus_build(
        [str(amazon_dir / name) for name in [*S3_FILES, HTTP_FILE[0]]],
        store=str(tmp_path / "local-store"),
        config=SMALL_SPLIT,
        show_progress=False,
    ).model_dump()
    assert local["corpus_id"] == summary["corpus_id"]
    assert {k: v for k, v in local.items() if k != "manifest_uri"} == {
        k: v for k, v in summary.items() if k != "manifest_uri"
    }
    local_manifest = json.loads(Path(local["manifest_uri"]).read_text())
    assert _shard_digests(local_manifest) == _shard_digests(manifest)
    base = Path(local["manifest_uri"]).parent
    for path, digest in _shard_digests(local_manifest):
        assert _sha256((base / path).read_bytes()) == digest
    assert local_manifest["totals"] == manifest["totals"]
    assert _counts(local_manifest) == _counts(manifest)


def _counts(manifest: dict[str, Any]) -> list[tuple[Any, ...]]:
    keys = ("name", "sha256", "records", "kept", "duplicates", "rejected")
    return [tuple(s[k] for k in keys) for s in manifest["sources"]]


def test_source_numbering_does_not_depend_on_location(
    http_root: tuple[str, Path], amazon_dir: Path, tmp_path: Path
) -> None:
    from corpus_helpers import build

    names = ["AMAZON_FASHION_5.json.gz", "Appliances_5.json.gz", "Gift_Cards_5.json.gz"]
    base, root = http_root
    folder = root / uuid.uuid4().hex[:8]
    folder.mkdir()
    (folder / names[0]).symlink_to(amazon_dir / names[0])
    try:
        local = build([amazon_dir / n for n in names], tmp_path / "local", SMALL_SPLIT)
        # "http://..." sorts after "/...": AMAZON_FASHION becomes the last source instead of the first.
        mixed = build(
            [f"{base}/{folder.name}/{names[0]}", *(amazon_dir / n for n in names[1:])],
            tmp_path / "mixed",
            SMALL_SPLIT,
        )
    finally:
        shutil.rmtree(folder)
    assert local.corpus_id == mixed.corpus_id
    assert local.totals == mixed.totals
    local_json, mixed_json = local.model_dump(by_alias=True), mixed.model_dump(by_alias=True)
    assert sorted(_counts(local_json)) == sorted(_counts(mixed_json))
    assert _shard_digests(local_json) == _shard_digests(mixed_json)


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLSTM_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_cli_builds_from_s3_into_s3(prefect_api_url: str, home: Path, raw_bucket: str) -> None:
    assert os.environ["AWS_ENDPOINT_URL"] and os.environ["PREFECT_API_URL"] == prefect_api_url
    result = _cli(
        [
            "corpus",
            "build",
            f"s3://{raw_bucket}/raw/Appliances_5.json.gz",
            "--store",
            f"s3://{raw_bucket}/store",
            "--split",
            "98:1:1",
            "--json",
        ],
        home,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    manifest = _check_published(raw_bucket, summary)
    assert [s["name"] for s in manifest["sources"]] == ["Appliances_5.json.gz"]
    assert manifest["sources"][0]["records"] == S3_FILES["Appliances_5.json.gz"]


@pytest.mark.slow
def test_cli_missing_s3_source_fails_cleanly(prefect_api_url: str, home: Path, raw_bucket: str) -> None:
    uri = f"s3://{raw_bucket}/nothing/"
    result = _cli(["corpus", "build", uri, "--store", f"s3://{raw_bucket}/store", "--json"], home)
    assert result.returncode == 2, result.stderr
    assert result.stdout.strip() == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert uri in errors[0]
    assert _s3_objects(raw_bucket, "store/") == {}
