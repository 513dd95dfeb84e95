"""The tables a scoring run reads: CSV, JSON lines (gzip too), Parquet and Arrow IPC, local or s3://.

Finding the files and hashing them are the corpus stage's own (``tasks.corpus.sources``); an s3://
file is read from a local copy, one a process (Parquet and Arrow need random access, and a window of a
CSV or JSON-lines file is read from its byte offset: in a gzip file, its offset in the uncompressed stream,
reached through a seek-point index, ``_gzip_range``). Here a file is read as a sequence of Arrow record
batches holding the text column and the id columns only. A row whose text cannot be scored (empty, not text, not UTF-8, longer
than the model reads) is not an error: ``texts_of`` says why, and the run writes it aside. A file that
cannot be read as its extension says, or lacks the text column, is one ``InputError`` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from tasks.corpus.sources import GZIP_MAGIC, Source, SourceError, expand_sources, fingerprint
from tasks.score.formats import FORMATS, SUFFIXES
from tasks.store import LocalStore, Store, split_object_uri

BATCH_ROWS = 4096  # rows per record batch read from a JSON-lines file
CSV_BLOCK_BYTES = 16 * 2**20  # pyarrow infers a CSV's column types from its first block
# A CSV or JSON-lines file's byte offset is recorded every OFFSET_ROWS rows when it is described (it
# is read whole then anyway), so a window is read from the offset at or before its first row, not from
# the file's start: reading a file's windows costs one reading of it, not one per window (a gzip file
# through a seek-point index, ``_gzip_range``). Windows start at multiples of piece_rows ×
# WINDOW_PIECES (16,384 by default), so they start on an offset.
OFFSET_ROWS = 1024
# A gzip file's seek points, one every GZIP_SPACING bytes of its uncompressed stream, each holding the
# 32 KiB of text before it: a window read decompresses at most this much beside its own bytes, and a
# process's index of a file takes 1/512 of its uncompressed size (80 MB for 40 GB).
GZIP_SPACING = 16 * 2**20
GZIP_READ_BYTES = 2**20  # of compressed bytes a gzip index reads at a time
SCAN_REPORT_BYTES = 8 * 2**20  # of lines between two reports of a line scan's progress
GZIP_CHECK_BYTES = 16 * 2**20  # of a gzip JSON-lines file's text read at a time to check it is whole


class InputError(SourceError):
    """An input file that cannot be scored as a whole; the message names it and says why."""


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One input table, identified by its content."""

    uri: str
    name: str
    format: str
    sha256: str
    size: int
    rows: int
    # Byte offsets of rows 0, OFFSET_ROWS, 2·OFFSET_ROWS, …: a CSV or JSON-lines file only, in a gzip
    # file's uncompressed stream (empty: read from the start; Parquet and Arrow seek themselves).
    offsets: tuple[int, ...] = ()
    # A gzip file's seek-point index as the describing process exported it (a local path, kept while
    # that process lives): a worker that finds it reads only its windows' bytes; one that does not
    # (a Dask worker on another machine) builds its own.
    gzip_index: str = ""
    # The index in the file's offsets of ``offsets[0]``: above 0 where they are a window's (``window``).
    offsets_from: int = 0
    # Gzip, by its magic bytes: a window is read through the index; a plain s3:// file's window by a
    # ranged GET of its own bytes (``_ranged_window``). None where not described: found from the first
    # bytes of the process's copy, never taken for plain.
    gzip: bool | None = None

    def window(self, start: int, stop: int) -> InputFile:
        """The file as a read of rows ``[start, stop)`` needs it: the offsets at or before ``start`` up to
        the one at or after ``stop``. A piece carries its window's file, not the whole file's offsets,
        so a task's arguments do not grow with the file (80,000 offsets for the 2014 corpus's 82M
        reviews, in each of its 80,000 pieces)."""
        if not self.offsets:
            return self
        first = start // OFFSET_ROWS - self.offsets_from
        last = -(-stop // OFFSET_ROWS) - self.offsets_from
        if not 0 <= first <= last:
            raise ValueError(f"rows {start}–{stop} are outside the offsets this file holds")
        return replace(self, offsets=self.offsets[first : last + 1], offsets_from=self.offsets_from + first)


def format_of(uri: str) -> str:
    name = uri.lower().rstrip("/")
    for suffix, kind in FORMATS.items():
        if name.endswith(suffix):
            return kind
    raise InputError(f"{uri}: not a table this command reads ({', '.join(SUFFIXES)})")


def expand_inputs(args: list[str], *, s3_endpoint_url: str | None = None) -> list[str]:
    """Files, folders, globs and s3:// prefixes → the sorted table files they name."""
    uris = expand_sources(args, s3_endpoint_url=s3_endpoint_url, suffixes=SUFFIXES)
    for uri in uris:
        format_of(uri)  # a file named outright must still be a table
    return uris


class _Progress:
    """A file's describing as the fraction of it done, told to ``report`` as it grows (an increment at a
    time): each pass over the file (the hash, the line scan, the parse) an equal share, a pass's share by
    the bytes or rows it has done of its total."""

    def __init__(self, report: Callable[[float], None], passes: int) -> None:
        self.report, self.share, self.done = report, 1 / passes, 0.0

    def at(self, done: float, total: float | None) -> None:
        """``done`` of the current pass's ``total`` (None: unknown, told at the pass's end)."""
        if total:
            fraction = min(done / total, 1.0)
            if fraction > self.done:
                self.report((fraction - self.done) * self.share)
                self.done = fraction

    def end_pass(self) -> None:
        self.at(1, 1)
        self.done = 0.0


def describe(
    uri: str,
    *,
    text_column: str,
    id_columns: list[str],
    s3_endpoint_url: str | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> InputFile:
    """Hash the file and count its rows: a file that is not what its extension says, or that lacks a
    column, fails here, before any row of any file is scored. A CSV or JSON-lines file's lines are
    scanned for the rows' byte offsets and its rows counted first; a CSV is then read window by window
    between them, as the workers will read it (``_csv_rows``), and a JSON-lines file up to its first
    record with the text field (``_check_text_field``; a gzip one through to its end, ``_check_gzip``).
    ``on_progress``: told the fraction of the file done as it grows, an increment at a time (the passes
    over a 40 GB file take minutes)."""
    kind = format_of(uri)
    store, key = split_object_uri(uri, endpoint_url=s3_endpoint_url)
    # The download (an s3:// file), the hash, the scan and the parse (a JSON-lines file's check; Parquet
    # and Arrow: the hash, the read).
    passes = (3 if kind in ("csv", "jsonl") else 2) + (not isinstance(store, LocalStore))
    progress = _Progress(on_progress or (lambda _: None), passes)

    def hashed(path: str, size: int) -> Source:
        return fingerprint(path, piece_bytes=2**62, on_read=lambda done: progress.at(done, size))

    if isinstance(store, LocalStore):
        source = hashed(uri, store.path(key).stat().st_size)
    else:
        source = _hashed_copy(store, key, uri, hashed, on_download=progress)
    progress.end_pass()
    offsets: tuple[int, ...] = ()
    scanned, index = 0, ""
    if kind in ("csv", "jsonl"):
        with _readable(uri, kind):
            offsets, scanned, index = row_offsets(
                uri, kind, s3_endpoint_url, source.sha256, on_read=lambda done: progress.at(done, source.size)
            )
        progress.end_pass()
    columns = [text_column, *id_columns]
    where = _Where(uri, s3_endpoint_url, sha256=source.sha256)  # an s3:// file: one copy for it all
    rows = None
    if kind == "jsonl":
        # The scan counts a JSON-lines file's rows as its reading does (a line that is not blank is a
        # row, whatever it holds): what is left to know is that it holds reviews, and that a gzip file
        # is whole. Parsing every line here took three quarters of describing (0.83 of 1.1 s for a
        # 134 MB file; 1.17 s for it gzipped, where reading it through takes 0.50 s).
        with _readable(uri, kind):
            _check_text_field(where, text_column)
            if source.gzip:
                _check_gzip(where, lambda done: progress.at(done, source.size))
        rows = scanned
    elif kind == "csv" and offsets:
        with _readable(uri, kind):
            rows = _csv_rows(
                where, columns, offsets, scanned, on_rows=lambda done: progress.at(done, scanned)
            )
    if rows is None:
        total = scanned or _stated_rows(uri, kind, s3_endpoint_url, source.sha256)
        batches = read_batches(
            uri,
            kind,
            text_column=text_column,
            id_columns=id_columns,
            s3_endpoint_url=s3_endpoint_url,
            sha256=source.sha256,
        )
        rows = 0
        for batch in batches:
            rows += batch.num_rows
            progress.at(rows, total)
    progress.end_pass()
    if scanned != rows:
        # The line scan and pyarrow disagree on this CSV (a lone \r line end): read from the start.
        offsets, index = (), ""
    # The describing process scores nothing: its copy of an s3:// file goes now, not when it exits.
    _drop_copy(uri, source.sha256)
    return InputFile(
        uri=uri,
        name=source.name,
        format=kind,
        sha256=source.sha256,
        size=source.size,
        rows=rows,
        offsets=offsets,
        gzip_index=index,
        gzip=source.gzip,
    )


def _csv_rows(
    where: _Where,
    columns: list[str],
    offsets: tuple[int, ...],
    scanned: int,
    on_rows: Callable[[int], None] = lambda _: None,
) -> int | None:
    """The CSV's rows, counted by pyarrow one window at a time (about two blocks, between the line
    scan's offsets), each window's bytes alone in memory and parsed as a worker parses them: the whole
    stream handed to pyarrow is read up to 32 blocks ahead of the rows parsed (describing a 520 MB CSV
    peaked at 0.50 GiB that way, at 0.21 GiB by windows). None where a window does not hold the rows the
    scan counted in it, or cannot be parsed: the caller then reads the stream whole, which names the
    error."""
    names, types = _layout(where, columns)
    first = 0
    windows: list[tuple[int, int]] = []
    for i, offset in enumerate(offsets):
        if offset - offsets[first] >= 2 * CSV_BLOCK_BYTES:
            windows.append((first, i))
            first = i
    windows.append((first, len(offsets)))
    with _opened(where) as stream:
        for first, last in windows:
            begin = offsets[first] if first else 0  # the first window holds the header
            data = stream.read(offsets[last] - begin) if last < len(offsets) else stream.read()
            expected = (last - first) * OFFSET_ROWS if last < len(offsets) else scanned - first * OFFSET_ROWS
            try:
                reader = _csv_reader(pa.BufferReader(data), begin, names, types, columns)
                if sum(batch.num_rows for batch in reader) != expected:
                    return None
            except (pa.ArrowException, UnicodeDecodeError):
                return None
            on_rows(first * OFFSET_ROWS + expected)  # the rows counted so far
    return scanned


def read_rows(
    file: InputFile,
    start: int,
    stop: int,
    *,
    text_column: str,
    id_columns: list[str],
    s3_endpoint_url: str | None = None,
) -> pa.Table:
    """Rows ``[start, stop)`` of the file (text and id columns), streamed: memory holds a batch. The read
    begins at the recorded offset (``OFFSET_ROWS``) or Parquet row group at or before ``start``."""
    kept: list[pa.RecordBatch] = []
    seen = start
    for batch in read_batches(
        file.uri,
        file.format,
        text_column=text_column,
        id_columns=id_columns,
        s3_endpoint_url=s3_endpoint_url,
        start=start,
        stop=stop,
        offsets=file.offsets,
        sha256=file.sha256,
        gzip_index=file.gzip_index,
        offsets_from=file.offsets_from,
        gzip=file.gzip,
    ):
        end = seen + batch.num_rows
        if end > start:
            kept.append(batch.slice(max(start - seen, 0), min(stop, end) - max(start, seen)))
        seen = end
        if seen >= stop:
            break
    if not kept:
        raise InputError(f"{file.uri}: has {seen} rows, rows {start}–{stop} were planned (did it change?)")
    return pa.Table.from_batches(kept).combine_chunks()


def read_batches(
    uri: str,
    kind: str,
    *,
    text_column: str,
    id_columns: list[str],
    s3_endpoint_url: str | None = None,
    start: int = 0,
    stop: int | None = None,
    offsets: tuple[int, ...] = (),
    sha256: str = "",
    gzip_index: str = "",
    offsets_from: int = 0,
    gzip: bool | None = None,
) -> Iterator[pa.RecordBatch]:
    """The file's text and id columns as record batches, text first, from row ``start`` on. CSV and JSON
    lines carry the text as bytes (``binary``), so one row of bad UTF-8 is that row's problem, not the
    file's. A CSV or JSON-lines file is read from the byte offset in ``offsets`` (``InputFile.offsets``)
    at or before ``start``, a Parquet file from the row group holding it, an Arrow IPC file from the
    record batch holding it; without offsets from its start. A gzip file read from an offset is read up to
    the offset at or after ``stop`` (``_gzip_range``); rows past ``stop`` may follow, as from any file.
    ``sha256``: the file's, where it was described, to keep what a read from an offset needs of its start
    (``_csv_layout``) and, for a gzip file, its index; ``gzip_index``: the index describing exported;
    ``offsets_from``: the index of ``offsets[0]`` among the file's (``InputFile.window``); ``gzip``: whether
    the file is (None: found from its first bytes)."""
    columns = [text_column, *id_columns]
    with _readable(uri, kind):
        if kind in ("csv", "jsonl"):
            # Indexes into the file's offsets; ``offsets`` begin at index ``offsets_from`` (a window's).
            stored = offsets_from + len(offsets)
            index = min(start // OFFSET_ROWS, stored - 1) if offsets else -1
            first, offset = (index * OFFSET_ROWS, offsets[index - offsets_from]) if index > 0 else (0, 0)
            last = -(-stop // OFFSET_ROWS) if stop is not None and offsets else stored
            end = offsets[last - offsets_from] if last < stored else None  # None: to the file's end
            where = _Where(uri, s3_endpoint_url, offset, end, sha256, gzip_index, gzip)
            batches = (_csv_batches if kind == "csv" else _jsonl_batches)(where, columns)
            yield from _from_row(batches, start - first)
        else:
            with _local(uri, s3_endpoint_url, sha256) as path:
                read = _parquet_batches if kind == "parquet" else _arrow_batches
                yield from read(uri, path, columns, start)


@contextlib.contextmanager
def _readable(uri: str, kind: str) -> Iterator[None]:
    """A read that fails is one error naming the file and the format it was read as."""
    try:
        yield
    except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError) as error:
        raise InputError(f"{uri}: not a readable {_FORMAT_NAMES[kind]} file ({error})") from None


def _from_row(batches: Iterator[pa.RecordBatch], skip: int) -> Iterator[pa.RecordBatch]:
    """The batches less their first ``skip`` rows."""
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        yield batch.slice(skip) if skip else batch
        skip = 0


def row_offsets(
    uri: str,
    kind: str,
    s3_endpoint_url: str | None = None,
    sha256: str = "",
    on_read: Callable[[int], None] = lambda _: None,
) -> tuple[tuple[int, ...], int, str]:
    """The byte offsets of rows 0, OFFSET_ROWS, 2·OFFSET_ROWS, … of a CSV or JSON-lines file (a gzip
    file's in its uncompressed stream), and the rows it has, by one scan of its lines: a JSON-lines row is
    a line that is not blank (as ``_jsonl_batches`` reads), a CSV row a record after the header, ending at
    a line end outside quotes (an even count of ``"`` so far: RFC 4180, as pyarrow reads it), empty lines
    skipped. A gzip file is scanned through a seek-point index, exported for the workers (its path is
    the third value; empty for a plain file). ``on_read``: told the bytes of the file read so far (a
    gzip file's compressed bytes), every ``SCAN_REPORT_BYTES`` of its lines."""
    offsets: list[int] = []
    rows = 0
    index = ""
    with _local(uri, s3_endpoint_url, sha256) as path, open(path, "rb") as raw:
        packed = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        with _new_index(raw) if packed else contextlib.nullcontext(raw) as stream:
            position, header, quoted = 0, kind == "csv", False
            report = SCAN_REPORT_BYTES
            for line in stream:
                begins, position = position, position + len(line)
                if position >= report:
                    on_read(raw.tell())
                    report = position + SCAN_REPORT_BYTES
                if kind == "jsonl":
                    record = bool(line.strip())
                else:
                    record = not quoted and bool(line.strip(b"\r\n"))
                    quoted ^= line.count(b'"') % 2 == 1
                    if record and header:
                        header, record = False, False
                if record:
                    if rows % OFFSET_ROWS == 0:
                        offsets.append(begins)
                    rows += 1
            if packed:
                index = _export_index(stream, sha256)
    return tuple(offsets), rows, index


_FORMAT_NAMES = {"csv": "CSV", "jsonl": "JSON-lines", "parquet": "Parquet", "arrow": "Arrow IPC"}


def _missing(uri: str, names: list[str], columns: list[str]) -> None:
    if absent := [c for c in columns if c not in names]:
        raise InputError(
            f"{uri}: no column {', '.join(map(repr, absent))} (it has {', '.join(map(repr, names[:20]))}); "
            "name the text with --text-column and the ids with --id-column"
        )


@dataclass(frozen=True)
class _Where:
    """Where a read of a CSV or JSON-lines file begins and ends: the file, its content's sha256 where it
    was described (an s3:// file is then copied once a process, a CSV's layout and a gzip file's index
    kept), a row's byte offset (a gzip file's in its uncompressed stream) and the one it reads up to
    (None: the file's end), the gzip index describing exported, and whether the file is gzip (None:
    not known, found from its first bytes)."""

    uri: str
    s3_endpoint_url: str | None = None
    offset: int = 0
    end: int | None = None
    sha256: str = ""
    index: str = ""
    gzip: bool | None = None


@contextlib.contextmanager
def _opened(where: _Where) -> Iterator[IO[bytes]]:
    """The file's bytes from ``where.offset``, gunzipped when they are gzip (by their magic bytes, as the
    corpus reads). A window that ends before the file does (``end``) is its bytes alone, in memory:
    pyarrow's CSV reader reads tens of blocks ahead of the rows taken (4 windows of a 520 MB CSV took a
    reader 558 MB), so a stream would cost a worker the file after its window. A gzip window past the
    file's start is read through the process's index of the file (``_gzip_range``); a plain s3:// file's
    window by a ranged GET (``_ranged_window``)."""
    if (window := _ranged_window(where)) is not None:
        yield io.BytesIO(window)
        return
    with _local(where.uri, where.s3_endpoint_url, where.sha256) as path, open(path, "rb") as raw:
        packed = raw.read(2) == GZIP_MAGIC
        raw.seek(0 if packed else where.offset)
        if packed and where.offset:
            yield io.BytesIO(_gzip_range(path, where.sha256, where.offset, where.end, where.index))
        elif packed:
            with gzip.GzipFile(fileobj=raw) as unzipped:
                yield unzipped if where.end is None else io.BytesIO(unzipped.read(where.end))  # type: ignore[misc]
        else:
            yield raw if where.end is None else io.BytesIO(raw.read(where.end - where.offset))


def _ranged_window(where: _Where) -> bytes | None:
    """The bytes of a window of a plain s3:// file by a ranged GET, where this process holds no copy of
    it: a copy a process would cost each worker the whole object (8 workers scoring a 40 GB CSV: 320 GB
    downloaded, and 40 GB of disk each). None where the read needs the copy: a gzip file (read through
    its index) or one not known to be plain, the whole file, or a file this process has copied."""
    if where.gzip is not False or (not where.offset and where.end is None):
        return None
    store, key = split_object_uri(where.uri, endpoint_url=where.s3_endpoint_url)
    if isinstance(store, LocalStore):
        return None
    with _copies_lock:
        if (where.uri, where.sha256) in _copies:
            return None
    with contextlib.closing(store.open_read(key, start=where.offset)) as body:
        return body.read() if where.end is None else body.read(where.end - where.offset)


# (path, sha256) → the open file and its index
_gzip_files: OrderedDict[tuple[str, str], tuple[IO[bytes], Any]] = OrderedDict()
_gzip_lock = threading.Lock()


def _new_index(raw: IO[bytes]) -> Any:
    """A gzip file read through a seek-point index (``indexed_gzip``) it builds as it is read."""
    import indexed_gzip

    return indexed_gzip.IndexedGzipFile(fileobj=raw, spacing=GZIP_SPACING, readbuf_size=GZIP_READ_BYTES)


def _export_index(unzipped: Any, sha256: str) -> str:
    """Write the index to this process's folder of them, for the workers on this machine."""
    path = _process_folder(INDEXES) / f"{sha256[:16] or 'file'}.gzidx"
    partial = path.with_suffix(".partial")
    unzipped.export_index(filename=str(partial))
    partial.replace(path)  # a worker never imports half an index
    return str(path)


def _gzip_range(path: str, sha256: str, begin: int, end: int | None, index: str = "") -> bytes:
    """Bytes ``[begin, end)`` of a gzip file's uncompressed stream (``end`` None: to its end), through a
    seek-point index (``indexed_gzip``) the process keeps for the file: the one describing exported
    (``index``) where this machine has it, then a read costs its own bytes and at most ``GZIP_SPACING``
    more; otherwise one built as the process reads, which decompresses the file once, up to the furthest
    window the process reads, whatever their order. Kept open for the last ``COPIES_KEPT`` files, by
    content (a Dask worker outlives a run)."""
    with _gzip_lock:
        if (kept := _gzip_files.get((path, sha256))) is None:
            raw = open(path, "rb")  # noqa: SIM115 (kept open across reads: _close_gzip); tests count its reads
            kept = raw, _new_index(raw)
            if index and Path(index).is_file():
                try:
                    kept[1].import_index(filename=index)
                except OSError:  # not this file's, or unreadable: built here as the reads go
                    _close_gzip(*kept)
                    raw = open(path, "rb")  # noqa: SIM115 (as above)
                    kept = raw, _new_index(raw)
            _gzip_files[(path, sha256)] = kept
            while len(_gzip_files) > COPIES_KEPT:
                _close_gzip(*_gzip_files.popitem(last=False)[1])
        _gzip_files.move_to_end((path, sha256))
        unzipped = kept[1]
        unzipped.seek(begin)
        data: bytes = unzipped.read(-1 if end is None else end - begin)
        return data


def _close_gzip(raw: IO[bytes], unzipped: Any) -> None:
    unzipped.close()
    raw.close()


def _drop_gzip(path: Path | None = None) -> None:
    """Close the process's index of ``path`` (of every file: None): its copy is being deleted."""
    with _gzip_lock:
        for key in [k for k in _gzip_files if path is None or k[0] == str(path)]:
            _close_gzip(*_gzip_files.pop(key))


def _csv_batches(where: _Where, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """From the file's start, or from a row's offset with the header's names and the column types
    pyarrow inferred from the file's first block (as a read from the start has them)."""
    names, types = _layout(where, columns)
    with _opened(where) as stream:
        yield from _csv_reader(stream, where.offset, names, types, columns)


# A quoted value may hold line ends (a review's paragraphs, RFC 4180, as the line scan counts them). By
# default pyarrow cuts its blocks at any line end, so a block that began inside such a value failed the
# file ("CSV parser got out of sync with chunker"): every CSV over one block with multi-line texts.
_PARSE = pacsv.ParseOptions(newlines_in_values=True)


def _csv_reader(
    stream: IO[bytes] | pa.NativeFile,
    offset: int,
    names: tuple[str, ...],
    types: tuple[tuple[str, pa.DataType], ...],
    columns: list[str],
) -> Any:
    """pyarrow's reader of CSV bytes that begin at ``offset`` of the file: at 0 with the header (the
    types inferred from the first block), past it with the layout's names and types."""
    return pacsv.open_csv(
        stream,
        read_options=pacsv.ReadOptions(
            block_size=CSV_BLOCK_BYTES, column_names=list(names) if offset else None
        ),
        parse_options=_PARSE,
        convert_options=pacsv.ConvertOptions(
            include_columns=columns, column_types=dict(types) if offset else {columns[0]: pa.binary()}
        ),
    )


def _layout(where: _Where, columns: list[str]) -> tuple[tuple[str, ...], tuple[tuple[str, pa.DataType], ...]]:
    """The file's ``_csv_layout``, from its first blocks only: the file's start up to twice a block (not
    streamed, which would read tens of blocks ahead, ``_opened``)."""
    layout = _csv_layout if where.sha256 else _csv_layout.__wrapped__  # kept by content only
    first = _Where(
        where.uri, where.s3_endpoint_url, end=2 * CSV_BLOCK_BYTES, sha256=where.sha256, gzip=where.gzip
    )
    return layout(first, tuple(columns))


@functools.lru_cache(maxsize=4)
def _csv_layout(
    start: _Where, columns: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[tuple[str, pa.DataType], ...]]:
    """A CSV's header names and its columns' types as pyarrow reads them from the start (the types it
    infers from the first block). Kept by the file's content: a worker needs it for each window."""
    with _opened(start) as stream:
        first = stream.read()  # ``start`` ends after the first blocks: read once for both readers
    # The header alone first, to name a missing column before pyarrow's own error does.
    header = pacsv.open_csv(
        io.BytesIO(first), read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES), parse_options=_PARSE
    )
    _missing(start.uri, header.schema.names, list(columns))
    reader = pacsv.open_csv(
        io.BytesIO(first),
        read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
        parse_options=_PARSE,
        convert_options=pacsv.ConvertOptions(
            include_columns=list(columns), column_types={columns[0]: pa.binary()}
        ),
    )
    return tuple(header.schema.names), tuple((f.name, f.type) for f in reader.schema)


def _jsonl_batches(where: _Where, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """One record a line; a line that is not a JSON object keeps its row (its text is null, with the
    reason in ``_problem``) so that row numbers stay line numbers of records. A file with no object
    holding the text field is no JSON-lines table of reviews: one error (read from its start)."""
    text, ids = columns[0], columns[1:]
    found = where.offset > 0
    with _opened(where) as stream:
        values: dict[str, list[Any]] = {name: [] for name in columns}
        problems: list[str | None] = []
        for line in stream:
            if not line.strip():
                continue
            record, problem = _record(line)
            if record is not None and text in record:
                found = True
            elif record is not None:
                problem = f"no {text!r} field"
            record = record or {}
            values[text].append(_as_bytes(record.get(text)))
            for name in ids:
                values[name].append(record.get(name))
            problems.append(problem)
            if len(problems) == BATCH_ROWS:
                yield _jsonl_batch(values, problems, text)
                values, problems = {name: [] for name in columns}, []
        if problems:
            yield _jsonl_batch(values, problems, text)
    if not found:
        raise _no_text_field(where.uri, text)


def _check_gzip(where: _Where, on_read: Callable[[int], None]) -> None:
    """Read a gzip file through to its end, every member's CRC and length checked: the line scan's
    ``indexed_gzip`` stops without an error where a file is cut short, and would count the rows
    before the cut. ``on_read``: told the compressed bytes read so far."""
    with (
        _local(where.uri, where.s3_endpoint_url, where.sha256) as path,
        open(path, "rb") as raw,
        gzip.GzipFile(fileobj=raw) as unzipped,
    ):
        while unzipped.read(GZIP_CHECK_BYTES):
            on_read(raw.tell())


def _no_text_field(uri: str, text: str) -> InputError:
    return InputError(f"{uri}: no record has a {text!r} field; name the text with --text-column")


def _check_text_field(where: _Where, text: str) -> None:
    """A JSON-lines file is a table of reviews when some record holds the text field: read up to the
    first that does (its first line, as a rule), not the whole file."""
    with _opened(where) as stream:
        for line in stream:
            record, _ = _record(line) if line.strip() else (None, None)
            if record is not None and text in record:
                return
    raise _no_text_field(where.uri, text)


def _record(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    try:
        # Bad UTF-8 kept as surrogates: the row keeps its ids, its text is rejected as not UTF-8.
        record = json.loads(line.decode("utf-8", "surrogateescape"))
    except ValueError:
        return None, "not JSON"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    return record, None


def _as_bytes(value: Any) -> Any:
    # Texts go in as bytes like the CSV's; anything else is kept as a marker of its type.
    return (
        value.encode("utf-8", "surrogateescape")
        if isinstance(value, str)
        else _NotText(type(value).__name__, value)
    )


@dataclass(frozen=True)
class _NotText:
    type_name: str
    value: Any


def _jsonl_batch(values: dict[str, list[Any]], problems: list[str | None], text: str) -> pa.RecordBatch:
    reasons = [
        problem or (None if isinstance(v, bytes) else f"not text ({v.type_name})")
        for v, problem in zip(values[text], problems, strict=True)
    ]
    texts = pa.array([v if isinstance(v, bytes) else None for v in values[text]], type=pa.binary())
    ids = {name: pa.array(column) for name, column in values.items() if name != text}
    return pa.record_batch({text: texts, **ids, PROBLEM: pa.array(reasons, type=pa.string())})


PROBLEM = "_problem"  # a JSON-lines row's reason, when the line itself could not be read


@contextlib.contextmanager
def _local(uri: str, s3_endpoint_url: str | None, sha256: str = "") -> Iterator[str]:
    """A local path of the file: Parquet and Arrow are read by random access, and a CSV or JSON-lines
    window from its offset. An s3:// file whose content is known (``sha256``) is copied once for this
    process (``_kept_copy``), not once for each window it reads; otherwise for the block."""
    store, key = split_object_uri(uri, endpoint_url=s3_endpoint_url)
    if sha256 and not isinstance(store, LocalStore):
        yield str(_kept_copy(store, key, uri, sha256))
        return
    with store.local_copy(key) as path:
        yield str(path)


COPIES_KEPT = 2  # s3:// inputs a process keeps a copy of: the one it reads, and the one before
_copies: OrderedDict[tuple[str, str], Path] = OrderedDict()  # (URI, sha256) → the local copy
_copies_lock = threading.Lock()  # a Dask worker may run pieces on several threads
# This process's temporary folders (of s3:// copies, of exported gzip indexes) by their prefix.
COPIES, INDEXES = "mlstm-score-inputs-", "mlstm-score-gzip-index-"
_folders: dict[str, Path] = {}
_folders_lock = threading.Lock()


def _process_folder(prefix: str) -> Path:
    """This process's temporary folder ``prefix…``, made on the first call, removed when the process
    exits (a pool worker too: ``multiprocessing``'s finalizers run there, atexit's do not)."""
    with _folders_lock:
        if prefix not in _folders:
            import multiprocessing.util

            folder = _folders[prefix] = Path(tempfile.mkdtemp(prefix=prefix))
            multiprocessing.util.Finalize(
                None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, exitpriority=0
            )
        return _folders[prefix]


def _kept_copy(store: Store, key: str, uri: str, sha256: str) -> Path:
    """The process's local copy of an s3:// file, by its URI and content: downloaded on the first read,
    the oldest of more than ``COPIES_KEPT`` deleted, the folder removed when the process exits."""
    with _copies_lock:
        if (path := _copies.get((uri, sha256))) is not None:
            _copies.move_to_end((uri, sha256))
            return path
        path = _process_folder(COPIES) / f"{sha256[:16]}-{Path(key).name}"
        store.download(key, path)
        _keep(uri, sha256, path)
        return path


def _keep(uri: str, sha256: str, path: Path) -> None:
    """Hold ``path`` as the copy of ``(uri, sha256)``; the oldest of more than ``COPIES_KEPT`` go.
    Under ``_copies_lock``."""
    _copies[(uri, sha256)] = path
    while len(_copies) > COPIES_KEPT:
        _, oldest = _copies.popitem(last=False)
        _drop_gzip(oldest)
        oldest.unlink(missing_ok=True)


def _hashed_copy(
    store: Store, key: str, uri: str, hashed: Callable[[str, int], Source], *, on_download: _Progress
) -> Source:
    """Download an s3:// file whose content is not known yet, hash the copy (``hashed``: its path and
    size to its ``Source``) and keep it as the process's copy of that content (``_kept_copy``): the
    object crosses the network once for the hash, the line scan and the parse, not as a stream to hash
    and then a copy to read. ``on_download``: told the download's progress, a pass of its own."""
    folder = _process_folder(COPIES)
    handle, name = tempfile.mkstemp(dir=folder, prefix="describing-", suffix=f"-{Path(key).name}")
    os.close(handle)
    partial = Path(name)
    try:
        store.download(key, partial, on_read=on_download.at)
        on_download.end_pass()
        source = hashed(str(partial), partial.stat().st_size)
        path = partial.rename(folder / f"{source.sha256[:16]}-{Path(key).name}")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    with _copies_lock:
        _keep(uri, source.sha256, path)
    return replace(source, uri=uri, name=Path(key).name)


def _drop_copy(uri: str, sha256: str) -> None:
    with _copies_lock:
        if (path := _copies.pop((uri, sha256), None)) is not None:
            _drop_gzip(path)
            path.unlink(missing_ok=True)


def drop_copies() -> None:
    """Delete the process's copies of s3:// inputs and their folder (and close its gzip indexes)."""
    _drop_gzip()
    with _copies_lock, _folders_lock:
        _copies.clear()
        if (folder := _folders.pop(COPIES, None)) is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _stated_rows(uri: str, kind: str, s3_endpoint_url: str | None, sha256: str) -> int | None:
    """The rows a Parquet file's footer states (what its read's progress is told against); None for the
    other kinds (an Arrow file's read is a memory map: quick, told at its end)."""
    if kind != "parquet":
        return None
    import pyarrow.parquet as pq

    with _readable(uri, kind), _local(uri, s3_endpoint_url, sha256) as path, pq.ParquetFile(path) as parquet:
        return int(parquet.metadata.num_rows)


def _parquet_batches(uri: str, path: str, columns: list[str], start: int = 0) -> Iterator[pa.RecordBatch]:
    """From the row group holding ``start``: the groups before it are not decoded."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as parquet:
        _missing(uri, parquet.schema_arrow.names, columns)
        group_rows = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
        group, first = 0, 0
        while group < len(group_rows) - 1 and first + group_rows[group] <= start:
            first += group_rows[group]
            group += 1
        groups = range(group, len(group_rows))
        yield from _from_row(
            parquet.iter_batches(columns=columns, batch_size=BATCH_ROWS, row_groups=groups), start - first
        )


def _arrow_batches(uri: str, path: str, columns: list[str], start: int = 0) -> Iterator[pa.RecordBatch]:
    """Record batches of a memory-mapped file: those before ``start`` cost their length only."""
    with pa.memory_map(path) as source:
        try:
            reader: Any = pa.ipc.open_file(source)
            batches: Iterator[pa.RecordBatch] = (
                reader.get_batch(i) for i in range(reader.num_record_batches)
            )
        except pa.ArrowInvalid:  # an Arrow IPC stream, not a file
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        _missing(uri, reader.schema.names, columns)
        for batch in _from_row(batches, start):
            yield batch.select(columns)


def text_bytes(texts: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Each row's text length in bytes; 0 for a null or a value that is not text (rejected later)."""
    import pyarrow.compute as pc

    kind = texts.type
    kinds = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_string, pa.types.is_large_string)
    if not any(is_kind(kind) for is_kind in kinds):
        return np.zeros(len(texts), dtype=np.int64)
    return np.asarray(pc.binary_length(texts).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)


def texts_of(
    column: pa.Array, problems: pa.Array | None, *, max_chars: int
) -> tuple[list[str | None], list[str | None]]:
    """Each row's text, or None and the reason it cannot be scored."""
    texts: list[str | None] = []
    reasons: list[str | None] = []
    values = column.to_pylist()
    given = problems.to_pylist() if problems is not None else [None] * len(values)
    for value, problem in zip(values, given, strict=True):
        text, reason = _text(value, problem, max_chars)
        texts.append(text)
        reasons.append(reason)
    return texts, reasons


def _text(value: Any, problem: str | None, max_chars: int) -> tuple[str | None, str | None]:
    if problem:
        return None, problem
    if value is None:
        return None, "empty (null)"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            return None, f"not UTF-8 at byte {error.start}"
    if not isinstance(value, str):
        return None, f"not text ({type(value).__name__})"
    if not value.strip():
        return None, "empty"
    if len(value) > max_chars:
        return None, f"{len(value):,} characters, more than the model's limit of {max_chars:,}"
    return value, None
