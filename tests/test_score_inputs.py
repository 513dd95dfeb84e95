"""The score command's readers (issue 30): a window of a file is read from where it begins, not from the
file's start, and gives the rows a read from the start gives (CSV, JSON lines, gzip, Parquet); describing
tells its progress pass by pass; a damaged gzip file is one error naming it; a piece's task arguments do
not grow with the plan; every format has its reader; which files a folder or a name gives. No model, no
Prefect: files written here. What a read costs: ``test_score_read_costs.py``; s3:// inputs:
``test_score_s3_inputs.py``."""

from __future__ import annotations

import collections
import gzip
import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from score_helpers import ROWS, read_whole, read_window, write_csv, write_jsonl

from tasks.corpus.sources import SourceError
from tasks.score import inputs
from tasks.score.readers import base, csv_file, json_lines
from tasks.score.readers import lines as line_files


@pytest.mark.parametrize("make", [write_csv, write_jsonl], ids=["csv", "jsonl"])
def test_a_window_is_read_from_its_offset_and_holds_the_rows_a_read_from_the_start_does(
    make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make(tmp_path / ("reviews.csv" if make is write_csv else "reviews.jsonl"))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert file.rows == ROWS and len(file.offsets) == 3 and list(file.offsets) == sorted(set(file.offsets))
    whole = read_whole(file)

    opened: list[int] = []
    real = line_files.opened
    monkeypatch.setattr(
        line_files,
        "opened",
        lambda where: opened.append(where.offset) or real(where),
    )
    csv_file._csv_layout.cache_clear()
    for start, stop in [(0, 1024), (1024, 2048), (2048, ROWS), (1500, 2100)]:
        assert read_window(file, start, stop).equals(whole.slice(start, stop - start)), (start, stop)
    # The rows' reads open the file at the offset at or before their first row (a CSV's layout, the
    # header and the column types of its first block, is read from the start once, in one opening, and kept).
    layout = [0] if make is write_csv else []
    assert opened == [*layout, 0, file.offsets[1], file.offsets[2], file.offsets[1]], opened


def test_a_csv_of_many_blocks_whose_texts_hold_line_ends_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow cut its blocks at any line end, so a block that began inside a quoted multi-line text
    failed the file ("CSV parser got out of sync with chunker"): a 33 MB CSV of reviews in paragraphs
    could not be described. Blocks of 4 KiB here: the file is a dozen of them."""
    monkeypatch.setattr(csv_file, "CSV_BLOCK_BYTES", 2**12)
    file = inputs.describe(str(write_csv(tmp_path / "reviews.csv")), text_column="text", id_columns=["id"])
    assert file.rows == ROWS and len(file.offsets) == 3
    window = read_window(file, 1024, 2048)
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
        assert read_window(window, start, stop).equals(read_window(file, start, stop)), (start, stop)
        # Both reads span the same bytes: from the offset at or before start to the one at or after stop.
        assert spans[-1] == spans[-2], spans
        assert read_window(window, start, stop).column("id").to_pylist() == list(range(start, stop))
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
@pytest.mark.parametrize("make", [write_csv, write_jsonl], ids=["csv", "jsonl"])
def test_a_gzip_window_is_read_from_its_offset_in_the_uncompressed_stream(
    make: Any, members: int, tmp_path: Path
) -> None:
    """A gzip file's offsets are the plain file's; its windows, in any order, hold the rows a read from
    the start does, in one gzip member or several (concatenated, cut anywhere)."""
    plain = make(tmp_path / ("reviews.csv" if make is write_csv else "reviews.jsonl"))
    path = plain.with_name(plain.name + ".gz")
    data = plain.read_bytes()
    cut = -(-len(data) // members)
    path.write_bytes(b"".join(gzip.compress(data[i : i + cut]) for i in range(0, len(data), cut)))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert (file.rows, file.offsets) == (
        ROWS,
        inputs.describe(str(plain), text_column="text", id_columns=[]).offsets,
    )
    whole = read_whole(file)
    for start, stop in [(2048, ROWS), (0, 1024), (1500, 2100), (1024, 2048)]:
        assert read_window(file, start, stop).equals(whole.slice(start, stop - start)), (start, stop)


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
    csv = write_csv(tmp_path / "reviews.csv")
    if kind == "csv.gz":
        path = tmp_path / "reviews.csv.gz"
        path.write_bytes(gzip.compress(csv.read_bytes()))
    elif kind.startswith("jsonl"):
        path = write_jsonl(tmp_path / "reviews.jsonl")
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


def test_a_csv_whose_line_ends_the_scan_does_not_see_has_no_offsets(tmp_path: Path) -> None:
    """Lone carriage returns end pyarrow's rows but not a Python line: the counts disagree, so the file's
    windows are read from its start rather than from wrong offsets."""
    path = tmp_path / "mac.csv"
    path.write_bytes(b"id,text\r" + b"".join(b"%d,review %d\r" % (i, i) for i in range(ROWS)))
    file = inputs.describe(str(path), text_column="text", id_columns=["id"])
    assert file.rows == ROWS and file.offsets == ()
    assert read_window(file, 2048, 2100).column("id").to_pylist() == list(range(2048, 2100))


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
    assert read_window(file, 2048, 2100).column("id").to_pylist() == list(range(2048, 2100))
    assert groups == [[2]]


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
@pytest.mark.parametrize("make", [write_csv, write_jsonl], ids=["csv", "jsonl"])
def test_a_damaged_gzip_file_is_one_error_naming_it(make: Any, damage: str, tmp_path: Path) -> None:
    name = "reviews.csv" if make is write_csv else "reviews.jsonl"
    packed = gzip.compress(make(tmp_path / name).read_bytes())
    path = tmp_path / f"{name}.gz"
    if damage == "truncated":
        path.write_bytes(packed[: len(packed) // 2])
    else:  # a run of bytes overwritten in the middle of the stream
        middle = len(packed) // 2
        path.write_bytes(packed[:middle] + bytes(64) + packed[middle + 64 :])
    kind = "CSV" if make is write_csv else "JSON-lines"
    with pytest.raises(inputs.InputError, match=f"^{path}: not a readable {kind} file"):
        inputs.describe(str(path), text_column="text", id_columns=["id"])


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
