"""The score command's s3:// inputs (moto; issue 30): a gzip input is copied once a process whatever
number of windows it reads, and its index goes with the copy; a plain input's windows are read by ranged
GETs, not copied; describing tells the download as a pass of its own; a failed download leaves no partial
copy."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
from pathlib import Path
from typing import Any

import pytest
from score_helpers import ROWS, read_whole, read_window, write_csv, write_jsonl

from tasks.score import inputs
from tasks.score.readers import copies, folders, gzip_index


def _watch_s3(monkeypatch: pytest.MonkeyPatch, seen: list[Any], opened: Any) -> None:
    """Note each S3 download (its key) and each GET of an object (``opened(key, start)``) in ``seen``."""
    from tasks.store import S3Store

    download, open_read = S3Store.download, S3Store.open_read
    monkeypatch.setattr(
        S3Store,
        "download",
        lambda self, key, local, **kw: seen.append(key) or download(self, key, local, **kw),
    )
    monkeypatch.setattr(
        S3Store,
        "open_read",
        lambda self, key, start=0: seen.append(opened(key, start)) or open_read(self, key, start=start),
    )


def test_an_s3_input_is_copied_once_a_process_whatever_number_of_windows_it_reads(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Describing downloads a file once for its hash, its line scan and its parse (no stream of the
    object besides) and drops the copy; a worker's windows of a gzip file (read through its index, from a
    copy) then cost one download; a third file drops the oldest copy (COPIES_KEPT 2), and the folder goes
    with the process."""
    import boto3

    downloads: list[Any] = []
    _watch_s3(monkeypatch, downloads, lambda key, start: f"stream {key}")
    copies.drop_copies()
    s3 = boto3.client("s3")
    made = {"a.csv.gz": write_csv, "b.jsonl.gz": write_jsonl, "c.csv.gz": write_csv}
    for name, make in made.items():
        (tmp_path / name).write_bytes(gzip.compress(make(tmp_path / name.removesuffix(".gz")).read_bytes()))
        s3.upload_file(str(tmp_path / name), s3_bucket, f"in/{name}")
    files = {
        name: inputs.describe(f"s3://{s3_bucket}/in/{name}", text_column="text", id_columns=["id"])
        for name in made
    }
    assert downloads == list(made) and not any(folders._folders[folders.COPIES].iterdir())
    local = inputs.describe(str(tmp_path / "a.csv.gz"), text_column="text", id_columns=["id"])
    a = files["a.csv.gz"]
    assert (a.rows, a.offsets, a.sha256) == (local.rows, local.offsets, local.sha256)

    whole = read_whole(local)
    for start, stop in [(0, 1024), (1024, 2048), (2048, ROWS)]:
        assert read_window(a, start, stop).equals(whole.slice(start, stop - start))
    assert downloads == [*made, "a.csv.gz"]
    read_window(files["b.jsonl.gz"], 2048, 2100)
    read_window(files["c.csv.gz"], 2048, 2100)
    folder = folders._folders[folders.COPIES]
    assert len(list(folder.iterdir())) == copies.COPIES_KEPT
    read_window(a, 0, 10)  # a's copy was the oldest: copied again
    assert downloads == [*made, "a.csv.gz", "b.jsonl.gz", "c.csv.gz", "a.csv.gz"]
    copies.drop_copies()
    assert not folder.exists()
    # A file made without describing it (gzip unknown) is read from a copy, never as plain bytes.
    bare = inputs.InputFile(**{k: v for k, v in dataclasses.asdict(a).items() if k != "gzip"})
    assert read_window(bare, 1024, 2048).equals(whole.slice(1024, 1024))
    assert downloads[-1] == "a.csv.gz"
    copies.drop_copies()


@pytest.mark.parametrize("make", [write_csv, write_jsonl], ids=["csv", "jsonl"])
def test_a_plain_s3_input_s_windows_are_read_by_ranged_gets_not_copied(
    make: Any, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads a window of a plain s3:// file by a ranged GET of its own bytes, not from a copy of
    the whole object (each of 8 workers scoring a 40 GB CSV copied it): no download, each GET from the
    window's offset (a CSV's first blocks too, for its layout), the rows a local read gives."""
    import boto3

    name = "a.csv" if make is write_csv else "a.jsonl"
    boto3.client("s3").upload_file(str(make(tmp_path / name)), s3_bucket, f"in/{name}")
    copies.drop_copies()
    file = inputs.describe(f"s3://{s3_bucket}/in/{name}", text_column="text", id_columns=["id"])
    assert not file.gzip and len(file.offsets) == 3
    got: list[Any] = []
    _watch_s3(monkeypatch, got, lambda key, start: start)
    whole = read_whole(inputs.describe(str(tmp_path / name), text_column="text", id_columns=["id"]))
    for start, stop in [(1024, 2048), (2048, ROWS), (0, 1024)]:
        assert read_window(file, start, stop).equals(whole.slice(start, stop - start))
    layout = [0] if make is write_csv else []  # read once a process, with the first window
    assert got == [*layout, file.offsets[1], file.offsets[2], 0], got
    assert not any(folders._folders[folders.COPIES].iterdir())


def test_describing_an_s3_input_tells_its_download_as_a_pass(s3_bucket: str, tmp_path: Path) -> None:
    """A 40 GB object's download takes minutes before its hash starts: it is a pass of its own, its
    share told as the bytes come (``S3Store.download``'s ``on_read``), then the hash, scan and parse."""
    import boto3

    boto3.client("s3").upload_file(str(write_csv(tmp_path / "a.csv")), s3_bucket, "in/a.csv")
    told: list[float] = []
    inputs.describe(f"s3://{s3_bucket}/in/a.csv", text_column="text", id_columns=[], on_progress=told.append)
    done = list(itertools.accumulate(told))
    assert done[-1] == pytest.approx(1.0) and all(step > 0 for step in told)
    assert [round(d, 9) for d in done].count(0.25) == 1, done  # the download's quarter, then the others
    copies.drop_copies()


def test_an_s3_download_that_fails_leaves_no_partial_copy(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.store import S3Store

    def broken(self: Any, key: str, local: Path, **kwargs: Any) -> None:
        Path(local).write_bytes(b"id,text\n1,half a")
        raise OSError("connection reset")

    monkeypatch.setattr(S3Store, "download", broken)
    copies.drop_copies()
    with pytest.raises(OSError, match="connection reset"):
        inputs.describe(f"s3://{s3_bucket}/in/a.csv", text_column="text", id_columns=[])
    assert not list(folders._folders[folders.COPIES].iterdir()) and not copies._copies
    copies.drop_copies()


def test_an_s3_gzip_input_is_read_by_windows_from_the_process_s_copy(s3_bucket: str, tmp_path: Path) -> None:
    """The index is of the process's copy: it goes when the copy does."""
    import boto3

    plain = write_csv(tmp_path / "reviews.csv")
    path = tmp_path / "reviews.csv.gz"
    path.write_bytes(gzip.compress(plain.read_bytes()))
    boto3.client("s3").upload_file(str(path), s3_bucket, "in/reviews.csv.gz")
    copies.drop_copies()
    remote = inputs.describe(f"s3://{s3_bucket}/in/reviews.csv.gz", text_column="text", id_columns=["id"])
    local = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert (remote.rows, remote.offsets, remote.sha256) == (local.rows, local.offsets, local.sha256)
    whole = read_whole(local)
    for start, stop in [(2048, ROWS), (1024, 2048), (0, 1024)]:
        assert read_window(remote, start, stop).equals(whole.slice(start, stop - start)), (start, stop)
    folder = folders._folders[folders.COPIES]
    assert [Path(p).parent for p, _ in gzip_index._gzip_files] == [folder]
    copies.drop_copies()
    assert not gzip_index._gzip_files and not folder.exists()
