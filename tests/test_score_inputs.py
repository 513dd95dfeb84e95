"""The score command's readers (issue 30): a window of a file is read from where it begins, not from the
file's start, and gives the rows a read from the start gives. No model, no Prefect: files written here."""

from __future__ import annotations

import collections
import dataclasses
import gzip
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.corpus.sources import SourceError
from tasks.score import inputs
from tasks.score.readers import base, copies, csv_file, folders, gzip_index, json_lines
from tasks.score.readers import lines as line_files

ROWS = 3000  # three offsets at OFFSET_ROWS 1,024


def _csv(path: Path) -> Path:
    """Quoted texts over several lines, doubled quotes, and empty lines pyarrow skips."""
    lines = ["id,text,extra"]
    for i in range(ROWS):
        text = f'"a review over\nlines, ""quoted"" {i}"' if i % 3 == 0 else f"plain review {i}"
        lines.append(f"{i},{text},x{i % 7}")
        if i % 500 == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def _jsonl(path: Path) -> Path:
    """Blank lines (no row) and a line that is not JSON (a row, rejected later)."""
    lines = []
    for i in range(ROWS):
        lines.append(json.dumps({"id": i, "text": f"review {i} " * (i % 5 + 1)}) if i % 700 else "{not json")
        if i % 400 == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def _read(file: inputs.InputFile, start: int, stop: int) -> pa.Table:
    return inputs.read_rows(file, start, stop, text_column="text", id_columns=["id"])


def _whole(file: inputs.InputFile) -> pa.Table:
    batches = inputs.read_batches(file.uri, file.format, text_column="text", id_columns=["id"])
    return pa.Table.from_batches(list(batches)).combine_chunks()


@pytest.mark.parametrize("make", [_csv, _jsonl], ids=["csv", "jsonl"])
def test_a_window_is_read_from_its_offset_and_holds_the_rows_a_read_from_the_start_does(
    make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make(tmp_path / ("reviews.csv" if make is _csv else "reviews.jsonl"))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert file.rows == ROWS and len(file.offsets) == 3 and list(file.offsets) == sorted(set(file.offsets))
    whole = _whole(file)

    opened: list[int] = []
    real = line_files.opened
    monkeypatch.setattr(
        line_files,
        "opened",
        lambda where: opened.append(where.offset) or real(where),
    )
    csv_file._csv_layout.cache_clear()
    for start, stop in [(0, 1024), (1024, 2048), (2048, ROWS), (1500, 2100)]:
        assert _read(file, start, stop).equals(whole.slice(start, stop - start)), (start, stop)
    # The rows' reads open the file at the offset at or before their first row (a CSV's layout, the
    # header and the column types of its first block, is read from the start once, in one opening, and kept).
    layout = [0] if make is _csv else []
    assert opened == [*layout, 0, file.offsets[1], file.offsets[2], file.offsets[1]], opened


def test_a_csv_of_many_blocks_whose_texts_hold_line_ends_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow cut its blocks at any line end, so a block that began inside a quoted multi-line text
    failed the file ("CSV parser got out of sync with chunker"): a 33 MB CSV of reviews in paragraphs
    could not be described. Blocks of 4 KiB here: the file is a dozen of them."""
    monkeypatch.setattr(csv_file, "CSV_BLOCK_BYTES", 2**12)
    file = inputs.describe(str(_csv(tmp_path / "reviews.csv")), text_column="text", id_columns=["id"])
    assert file.rows == ROWS and len(file.offsets) == 3
    window = _read(file, 1024, 2048)
    assert window.column("id").to_pylist() == list(range(1024, 2048))
    assert window.column("text")[2].as_py() == b'a review over\nlines, "quoted" 1026'


@pytest.mark.parametrize("packed", [False, True], ids=["csv", "csv.gz"])
def test_a_window_s_file_holds_its_offsets_only_and_reads_the_rows_the_whole_file_does(
    packed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = 10 * line_files.OFFSET_ROWS + 300
    body = "id,text\n" + "".join(f'{i},"review\n{i}"\n' for i in range(rows))
    path = tmp_path / ("reviews.csv.gz" if packed else "reviews.csv")
    path.write_bytes(gzip.compress(body.encode()) if packed else body.encode())
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert len(file.offsets) == 11
    spans: list[tuple[int, int | None]] = []
    real = line_files.opened
    monkeypatch.setattr(
        line_files, "opened", lambda where: spans.append((where.offset, where.end)) or real(where)
    )
    for start, stop in [(0, 1500), (1500, 2600), (4096, 5120), (9000, rows), (rows - 1, rows)]:
        window = file.window(start, stop)
        assert len(window.offsets) <= (stop - start) // line_files.OFFSET_ROWS + 2, (
            start,
            stop,
            window.offsets,
        )
        spans.clear()
        assert _read(window, start, stop).equals(_read(file, start, stop)), (start, stop)
        # Both reads span the same bytes: from the offset at or before start to the one at or after stop.
        assert spans[-1] == spans[-2], spans
        assert _read(window, start, stop).column("id").to_pylist() == list(range(start, stop))
    # A window of a window is the same window; rows outside it are refused, not read from elsewhere.
    assert file.window(4096, 5120).window(4096, 5120) == file.window(4096, 5120)
    with pytest.raises(ValueError, match="outside the offsets"):
        file.window(4096, 5120).window(0, 100)


def test_a_piece_s_task_arguments_do_not_grow_with_the_plan() -> None:
    """Each piece's task took the whole plan, every piece and every offset: O(N²) to send and for Prefect
    to walk (99 ms a task at 3,907 pieces of one file). A piece's task now takes the plan without its
    pieces and the piece with its window's offsets: the same size at 1M rows as at 8M."""
    import pickle

    from tasks.score.scoring import ModelRef, plan_scoring

    model = ModelRef(
        uri="models:/m@champion", name="m", version=1, run_id=None, folder="m", unit=0,
        max_text_chars=10_000, weights_sha256="0" * 64,
    )  # fmt: skip

    def task_bytes(rows: int) -> int:
        offsets = tuple(i * 1300 * line_files.OFFSET_ROWS for i in range(-(-rows // line_files.OFFSET_ROWS)))
        file = inputs.InputFile(
            uri="big.csv", name="big.csv", format="csv", sha256="0" * 64, size=rows * 1300, rows=rows,
            offsets=offsets,
        )  # fmt: skip
        plan = plan_scoring((file,), "out", model)
        assert plan.files == (file,)  # the flow's own plan keeps them, for the manifest
        return max(len(pickle.dumps((plan.for_pieces(), piece))) for piece in plan.pieces[::97])

    small, large = task_bytes(1_000_000), task_bytes(8_000_000)
    assert large < 1.1 * small, (small, large)


@pytest.mark.parametrize("members", [1, 9])
@pytest.mark.parametrize("make", [_csv, _jsonl], ids=["csv", "jsonl"])
def test_a_gzip_window_is_read_from_its_offset_in_the_uncompressed_stream(
    make: Any, members: int, tmp_path: Path
) -> None:
    """A gzip file's offsets are the plain file's; its windows, in any order, hold the rows a read from
    the start does, in one gzip member or several (concatenated, cut anywhere)."""
    plain = make(tmp_path / ("reviews.csv" if make is _csv else "reviews.jsonl"))
    path = plain.with_name(plain.name + ".gz")
    data = plain.read_bytes()
    cut = -(-len(data) // members)
    path.write_bytes(b"".join(gzip.compress(data[i : i + cut]) for i in range(0, len(data), cut)))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert (file.rows, file.offsets) == (
        ROWS,
        inputs.describe(str(plain), text_column="text", id_columns=[]).offsets,
    )
    whole = _whole(file)
    for start, stop in [(2048, ROWS), (0, 1024), (1500, 2100), (1024, 2048)]:
        assert _read(file, start, stop).equals(whole.slice(start, stop - start)), (start, stop)


class _CountedFile:
    """A file that counts the bytes read from it, with no ``fileno``: indexed_gzip reads through it
    rather than from the descriptor."""

    def __init__(self, raw: Any, counts: list[int]) -> None:
        self._raw, self._counts = raw, counts

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._raw.read(size)
        self._counts.append(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        done: int = self._raw.readinto(buffer)
        self._counts.append(done)
        return done

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _CountedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()


def _counted_gzip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, windows: int
) -> tuple[inputs.InputFile, list[int]]:
    """A JSON-lines gzip file of ``windows`` × OFFSET_ROWS rows of noise (3 MB for 24), described with
    seek points and reads as dense, for its size, as for a file of gigabytes; then every byte read from
    it is counted."""
    import random

    noise = random.Random(0)
    lines = [
        json.dumps({"id": i, "text": noise.randbytes(64).hex()})
        for i in range(windows * line_files.OFFSET_ROWS)
    ]
    path = tmp_path / "reviews.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(lines).encode() + b"\n"))
    monkeypatch.setattr(gzip_index, "GZIP_SPACING", 2**16)
    monkeypatch.setattr(gzip_index, "GZIP_READ_BYTES", 2**14)
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert file.rows == windows * line_files.OFFSET_ROWS and len(file.offsets) == windows and file.gzip_index
    counts: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> _CountedFile:
        return _CountedFile(open(*args, **kwargs), counts)

    _count_opens(monkeypatch, counted)
    gzip_index.drop_index()
    return file, counts


def _count_opens(monkeypatch: pytest.MonkeyPatch, counted: Any) -> None:
    """Every file a read opens, through ``counted``: a window's bytes (``line_files``) and a gzip index's."""
    for module in (line_files, gzip_index):
        monkeypatch.setattr(module, "open", counted, raising=False)


def _window(file: inputs.InputFile, w: int) -> None:
    rows = line_files.OFFSET_ROWS
    assert _read(file, w * rows, (w + 1) * rows).column("id").to_pylist() == list(
        range(w * rows, (w + 1) * rows)
    )


def test_a_window_of_a_plain_csv_reads_its_own_bytes_not_the_file_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow's CSV reader reads tens of blocks ahead of the rows taken: a window streamed from its
    offset read on into the file after it (4 windows of a 520 MB CSV took a reader 558 MB)."""
    import random

    noise = random.Random(0)
    windows = 24
    rows = [f"{i},{noise.randbytes(64).hex()}" for i in range(windows * line_files.OFFSET_ROWS)]
    path = tmp_path / "reviews.csv"
    path.write_text("id,text\n" + "\n".join(rows) + "\n")
    monkeypatch.setattr(csv_file, "CSV_BLOCK_BYTES", 2**14)  # a window is about ten blocks, as in real files
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    _window(file, 3)  # the file's layout, read once a process
    counts: list[int] = []
    counted = lambda *a, **k: _CountedFile(open(*a, **k), counts)  # noqa: E731, SIM115 (closed by the reader)
    _count_opens(monkeypatch, counted)
    _window(file, windows // 2)
    window_bytes = file.offsets[windows // 2 + 1] - file.offsets[windows // 2]
    assert sum(counts) <= window_bytes + 2, f"{sum(counts) / window_bytes:.1f} windows' bytes read for one"


def test_describing_a_csv_holds_a_window_of_it_not_pyarrow_s_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow reads a stream up to 32 blocks ahead of the rows it parses: describing a 520 MB CSV by
    handing it the whole stream peaked at 0.6 GB. Read window by window (about two blocks each), the
    bytes Python holds stay a few blocks, and the rows and offsets are those of a read from the start."""
    import random
    import tracemalloc

    from tasks.corpus import sources

    noise = random.Random(0)
    rows = 64 * line_files.OFFSET_ROWS
    body = ("id,text\n" + "".join(f"{i},{noise.randbytes(64).hex()}\n" for i in range(rows))).encode()
    path = tmp_path / "reviews.csv"
    path.write_bytes(body)
    block = 2**16  # the file is 135 blocks
    monkeypatch.setattr(csv_file, "CSV_BLOCK_BYTES", block)
    monkeypatch.setattr(sources, "READ_CHUNK", block)  # the hashing's reads, not the point here
    # (A gzip file's line scan holds indexed_gzip's buffer of 4 seek-point spacings, whatever its size.)
    tracemalloc.start()
    try:
        file = inputs.describe(str(path), text_column="text", id_columns=["id"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert file.rows == rows and len(file.offsets) == 64
    assert peak < 16 * block, f"{peak / block:.1f} blocks held at once"
    assert _read(file, 40 * line_files.OFFSET_ROWS, 41 * line_files.OFFSET_ROWS).column(
        "id"
    ).to_pylist() == list(range(40 * line_files.OFFSET_ROWS, 41 * line_files.OFFSET_ROWS))


@pytest.mark.parametrize("kind", ["csv", "csv.gz", "jsonl", "jsonl.gz", "parquet"])
def test_describing_tells_its_progress_as_each_pass_goes(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashing, scanning and counting a 40 GB file take minutes: the fraction done grows within each
    pass over the file, not at its end only, and adds up to the whole file."""
    from tasks.corpus import sources
    from tasks.score.scoring import describe_inputs

    block = 2**12
    monkeypatch.setattr(csv_file, "CSV_BLOCK_BYTES", block)
    monkeypatch.setattr(line_files, "SCAN_REPORT_BYTES", block)
    monkeypatch.setattr(json_lines, "GZIP_CHECK_BYTES", block)
    monkeypatch.setattr(base, "BATCH_ROWS", 512)
    monkeypatch.setattr(sources, "READ_CHUNK", block)
    csv = _csv(tmp_path / "reviews.csv")
    if kind == "csv.gz":
        path = tmp_path / "reviews.csv.gz"
        path.write_bytes(gzip.compress(csv.read_bytes()))
    elif kind.startswith("jsonl"):
        path = _jsonl(tmp_path / "reviews.jsonl")
        if kind == "jsonl.gz":
            path.with_suffix(".jsonl.gz").write_bytes(gzip.compress(path.read_bytes()))
            path.unlink()
            path = path.with_suffix(".jsonl.gz")
    elif kind == "parquet":
        path = tmp_path / "reviews.parquet"
        pq.write_table(
            pa.table({"id": list(range(ROWS)), "text": [f"review {i}" for i in range(ROWS)]}), path
        )
    else:
        path = csv
    (folder := tmp_path / "in").mkdir()
    path.rename(folder / path.name)
    (folder / "zz.csv").write_bytes(b"id,text\n1,great\n")  # described second
    started: list[int] = []
    told: list[float] = []
    files = describe_inputs(
        [str(folder)], id_columns=["id"], on_start=started.append, on_progress=told.append
    )
    assert started == [2] and [f.name for f in files] == [path.name, "zz.csv"]
    assert all(step > 0 for step in told) and sum(told) == pytest.approx(2.0, abs=1e-9)
    # The first file's passes, each an equal share: the hash, the line scan (which counts a JSON-lines
    # file's rows) and the parse (a JSON-lines file's: its first record, and a gzip file read through);
    # Parquet's hash and read (against the rows its footer states). Each is told more than once, but a
    # plain JSON-lines file's check, told at its end.
    passes = 2 if kind == "parquet" else 3
    done = [d for d in itertools.accumulate(told) if d <= 1 + 1e-9]
    per_pass = collections.Counter(min(int(d * passes - 1e-9), passes - 1) for d in done)
    gradual = [per_pass[k] >= 2 for k in range(passes)]
    assert gradual == [True] * (passes - 1) + [kind != "jsonl"], per_pass


@pytest.mark.parametrize("packed", [False, True], ids=["jsonl", "jsonl.gz"])
def test_describing_a_json_lines_file_parses_it_up_to_its_first_record_with_the_text(
    packed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line scan counts the rows; parsing every line as well took three quarters of describing. A
    gzip file is still read through (the scan's indexed_gzip stops quietly at a cut), not parsed."""
    lines = [json.dumps({"id": i, "review": "no text field"}) for i in range(10)]
    lines += [json.dumps({"id": i, "text": f"review {i}"}) for i in range(10, ROWS)]
    body = ("\n".join(lines) + "\n").encode()
    path = tmp_path / ("reviews.jsonl.gz" if packed else "reviews.jsonl")
    path.write_bytes(gzip.compress(body) if packed else body)
    parsed: list[bytes] = []
    record = json_lines._record
    monkeypatch.setattr(json_lines, "_record", lambda line: parsed.append(line) or record(line))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert file.rows == ROWS and len(file.offsets) == 3
    assert len(parsed) == 11, len(parsed)  # up to the first record with "text"


def test_a_csv_that_parses_otherwise_than_its_lines_scan_is_counted_by_pyarrow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window whose count is not the scan's (here a lone carriage return inside a later window, which
    pyarrow ends a row at and the scan does not) sends the count to a read from the start."""
    monkeypatch.setattr(csv_file, "CSV_BLOCK_BYTES", 2**12)
    lines = [b"%d,review %d\n" % (i, i) for i in range(ROWS)]
    lines[2500] = b"2500,review\r99999,one more\n"
    path = tmp_path / "reviews.csv"
    path.write_bytes(b"id,text\n" + b"".join(lines))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert file.rows == ROWS + 1 and file.offsets == ()


@pytest.mark.parametrize("index", ["described", "built here"])
def test_a_gzip_file_s_windows_cost_about_one_reading_of_it_not_one_each(
    index: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading every window of a gzip file, in any order, reads its compressed bytes two or three times
    (the first windows' stream, the index built where the describing process's is not found, each
    window's own bytes and the distance from a seek point), not once for each window before the one
    read, as a gzip stream must."""
    windows = 24
    file, counts = _counted_gzip(tmp_path, monkeypatch, windows)
    if index == "built here":  # a Dask worker on another machine
        file = dataclasses.replace(file, gzip_index="")
    for w in [*range(0, windows, 2), *reversed(range(1, windows, 2))]:
        _window(file, w)
    readings = sum(counts) / Path(file.uri).stat().st_size
    assert readings <= 4, f"{readings:.1f} readings of the file for its {windows} windows"


def test_a_worker_with_the_described_index_reads_its_window_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index the describing process exported reaches a worker (``InputFile.gzip_index``): its one
    window near the file's end costs that window's bytes, not the file's before it; without the index
    the same window costs the whole file."""
    windows = 24
    file, counts = _counted_gzip(tmp_path, monkeypatch, windows)
    size = Path(file.uri).stat().st_size
    _window(file, windows - 2)
    with_index = sum(counts) / size
    gzip_index.drop_index()
    counts.clear()
    _window(dataclasses.replace(file, gzip_index=""), windows - 2)
    without = sum(counts) / size
    assert with_index <= 0.25 and without >= 0.9, f"{with_index:.2f}, without the index {without:.2f}"


def test_a_csv_whose_line_ends_the_scan_does_not_see_has_no_offsets(tmp_path: Path) -> None:
    """Lone carriage returns end pyarrow's rows but not a Python line: the counts disagree, so the file's
    windows are read from its start rather than from wrong offsets."""
    path = tmp_path / "mac.csv"
    path.write_bytes(b"id,text\r" + b"".join(b"%d,review %d\r" % (i, i) for i in range(ROWS)))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert file.rows == ROWS and file.offsets == ()
    assert _read(file, 2048, 2100).column("id").to_pylist() == list(range(2048, 2100))


def test_a_parquet_window_is_read_from_its_row_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = pa.table({"id": list(range(ROWS)), "text": [f"review {i}" for i in range(ROWS)]})
    path = tmp_path / "reviews.parquet"
    pq.write_table(table, path, row_group_size=1000)
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    groups: list[list[int]] = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        groups.append(list(kwargs["row_groups"]))
        return iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    assert _read(file, 2048, 2100).column("id").to_pylist() == list(range(2048, 2100))
    assert groups == [[2]]


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
    made = {"a.csv.gz": _csv, "b.jsonl.gz": _jsonl, "c.csv.gz": _csv}
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

    whole = _whole(local)
    for start, stop in [(0, 1024), (1024, 2048), (2048, ROWS)]:
        assert _read(a, start, stop).equals(whole.slice(start, stop - start))
    assert downloads == [*made, "a.csv.gz"]
    _read(files["b.jsonl.gz"], 2048, 2100)
    _read(files["c.csv.gz"], 2048, 2100)
    folder = folders._folders[folders.COPIES]
    assert len(list(folder.iterdir())) == copies.COPIES_KEPT
    _read(a, 0, 10)  # a's copy was the oldest: copied again
    assert downloads == [*made, "a.csv.gz", "b.jsonl.gz", "c.csv.gz", "a.csv.gz"]
    copies.drop_copies()
    assert not folder.exists()
    # A file made without describing it (gzip unknown) is read from a copy, never as plain bytes.
    bare = inputs.InputFile(**{k: v for k, v in dataclasses.asdict(a).items() if k != "gzip"})
    assert _read(bare, 1024, 2048).equals(whole.slice(1024, 1024))
    assert downloads[-1] == "a.csv.gz"
    copies.drop_copies()


@pytest.mark.parametrize("make", [_csv, _jsonl], ids=["csv", "jsonl"])
def test_a_plain_s3_input_s_windows_are_read_by_ranged_gets_not_copied(
    make: Any, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads a window of a plain s3:// file by a ranged GET of its own bytes, not from a copy of
    the whole object (each of 8 workers scoring a 40 GB CSV copied it): no download, each GET from the
    window's offset (a CSV's first blocks too, for its layout), the rows a local read gives."""
    import boto3

    name = "a.csv" if make is _csv else "a.jsonl"
    boto3.client("s3").upload_file(str(make(tmp_path / name)), s3_bucket, f"in/{name}")
    copies.drop_copies()
    file = inputs.describe(f"s3://{s3_bucket}/in/{name}", text_column="text", id_columns=["id"])
    assert not file.gzip and len(file.offsets) == 3
    got: list[Any] = []
    _watch_s3(monkeypatch, got, lambda key, start: start)
    whole = _whole(inputs.describe(str(tmp_path / name), text_column="text", id_columns=["id"]))
    for start, stop in [(1024, 2048), (2048, ROWS), (0, 1024)]:
        assert _read(file, start, stop).equals(whole.slice(start, stop - start))
    layout = [0] if make is _csv else []  # read once a process, with the first window
    assert got == [*layout, file.offsets[1], file.offsets[2], 0], got
    assert not any(folders._folders[folders.COPIES].iterdir())


def test_describing_an_s3_input_tells_its_download_as_a_pass(s3_bucket: str, tmp_path: Path) -> None:
    """A 40 GB object's download takes minutes before its hash starts: it is a pass of its own, its
    share told as the bytes come (``S3Store.download``'s ``on_read``), then the hash, scan and parse."""
    import boto3

    boto3.client("s3").upload_file(str(_csv(tmp_path / "a.csv")), s3_bucket, "in/a.csv")
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


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
@pytest.mark.parametrize("make", [_csv, _jsonl], ids=["csv", "jsonl"])
def test_a_damaged_gzip_file_is_one_error_naming_it(make: Any, damage: str, tmp_path: Path) -> None:
    name = "reviews.csv" if make is _csv else "reviews.jsonl"
    packed = gzip.compress(make(tmp_path / name).read_bytes())
    path = tmp_path / f"{name}.gz"
    if damage == "truncated":
        path.write_bytes(packed[: len(packed) // 2])
    else:  # a run of bytes overwritten in the middle of the stream
        middle = len(packed) // 2
        path.write_bytes(packed[:middle] + bytes(64) + packed[middle + 64 :])
    kind = "CSV" if make is _csv else "JSON-lines"
    with pytest.raises(inputs.InputError, match=f"^{path}: not a readable {kind} file"):
        inputs.describe(str(path), text_column="text", id_columns=["id"])


def test_an_s3_gzip_input_is_read_by_windows_from_the_process_s_copy(s3_bucket: str, tmp_path: Path) -> None:
    """The index is of the process's copy: it goes when the copy does."""
    import boto3

    plain = _csv(tmp_path / "reviews.csv")
    path = tmp_path / "reviews.csv.gz"
    path.write_bytes(gzip.compress(plain.read_bytes()))
    boto3.client("s3").upload_file(str(path), s3_bucket, "in/reviews.csv.gz")
    copies.drop_copies()
    remote = inputs.describe(f"s3://{s3_bucket}/in/reviews.csv.gz", text_column="text", id_columns=["id"])
    local = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert (remote.rows, remote.offsets, remote.sha256) == (local.rows, local.offsets, local.sha256)
    whole = _whole(local)
    for start, stop in [(2048, ROWS), (1024, 2048), (0, 1024)]:
        assert _read(remote, start, stop).equals(whole.slice(start, stop - start)), (start, stop)
    folder = folders._folders[folders.COPIES]
    assert [Path(p).parent for p, _ in gzip_index._gzip_files] == [folder]
    copies.drop_copies()
    assert not gzip_index._gzip_files and not folder.exists()


def test_every_format_the_command_takes_has_its_reader() -> None:
    """A suffix in ``formats.FORMATS`` names a format; the format's reader is chosen once from it."""
    from tasks.score.formats import FORMATS
    from tasks.score.readers import READERS

    assert set(FORMATS.values()) == set(READERS)


def test_an_output_inside_the_inputs_folder_is_not_read_as_an_input(tmp_path: Path) -> None:
    # `score in --output in/scores`, run twice: the second run must not take the first run's parts.
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "reviews.csv").write_text("text\ngreat\n")
    parts = tmp_path / "in" / "scores" / "abc123"
    parts.mkdir(parents=True)
    pq.write_table(pa.table({"probability": [0.5]}), parts / "part-00000.parquet")
    folder, output = str(tmp_path / "in"), str(tmp_path / "in" / "scores")
    assert len(inputs.expand_inputs([folder])) == 2  # what a folder holds
    assert inputs.expand_inputs([folder], output=output) == [str(tmp_path / "in" / "reviews.csv")]
    with pytest.raises(base.InputError, match="every input lies under --output"):
        inputs.expand_inputs([str(parts)], output=output)


def test_a_file_whose_name_holds_brackets_is_taken_as_named(tmp_path: Path) -> None:
    named = tmp_path / "reviews[2024].csv"
    named.write_text("text\ngreat\n")
    assert inputs.expand_inputs([str(named)]) == [str(named)]
    # A pattern that names no file is still a glob: [2024] is one character of those four.
    with pytest.raises(SourceError, match="the glob matches no file"):
        inputs.expand_inputs([str(tmp_path / "reviews[2024].json")])
