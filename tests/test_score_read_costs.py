"""What the score command's readers cost (issue 30), counted, not timed: a window of a plain CSV reads
its own bytes, not the file after it; describing a CSV holds a window of it, not pyarrow's read-ahead; a
gzip file's windows cost about one reading of it, not one each; a worker with the described index reads
its window only. Files written here."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
from pathlib import Path
from typing import Any

import pytest
from score_helpers import read_window

from tasks.score import inputs
from tasks.score.readers import csv_file, gzip_index
from tasks.score.readers import lines as line_files


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
    assert read_window(file, w * rows, (w + 1) * rows).column("id").to_pylist() == list(
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
    assert read_window(file, 40 * line_files.OFFSET_ROWS, 41 * line_files.OFFSET_ROWS).column(
        "id"
    ).to_pylist() == list(range(40 * line_files.OFFSET_ROWS, 41 * line_files.OFFSET_ROWS))


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
