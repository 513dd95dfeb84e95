"""The tables a scoring run reads (CSV, JSON lines, gzip too, Parquet and Arrow IPC; local or s3://),
described before any row is scored and then read a window of rows at a time.

Finding the files and hashing them are the corpus stage's own (``tasks.corpus.sources``); each format's
reading is its reader's (``readers``), chosen once by the file's format. A row whose text cannot be
scored is not an error (``readers.text``); a file that cannot be read as its extension says, or lacks
the text column, is one ``InputError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa

from tasks.corpus.sources import Source, expand_sources, fingerprint
from tasks.score.formats import FORMATS, SUFFIXES
from tasks.score.readers import copies, reader_for
from tasks.score.readers.base import InputError, Progress, Rows, Where
from tasks.score.readers.lines import OFFSET_ROWS
from tasks.store import LocalStore, split_object_uri


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
    # ranged GET of its own bytes. None where not described: found from the first bytes of the
    # process's copy, never taken for plain.
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


def expand_inputs(
    args: list[str], *, s3_endpoint_url: str | None = None, output: str | None = None
) -> list[str]:
    """Files, folders, globs and s3:// prefixes → the sorted table files they name, leaving out what
    lies under ``output`` (a run's own Parquet parts, when the output is a folder of the inputs)."""
    uris = expand_sources(args, s3_endpoint_url=s3_endpoint_url, suffixes=SUFFIXES)
    if output is not None:
        inside = _prefix_of(output)
        uris = [uri for uri in uris if not _prefix_of(uri).startswith(inside)]
        if not uris:
            raise InputError(f"every input lies under --output {output}: nothing left to score")
    for uri in uris:
        format_of(uri)  # a file named outright must still be a table
    return uris


def _prefix_of(uri: str) -> str:
    """A URI as a prefix that the URIs under it start with: a local path made absolute, ending in '/'."""
    if "://" in uri and not uri.startswith("file://"):
        return uri.rstrip("/") + "/"
    return str(Path(uri.removeprefix("file://")).resolve()) + "/"


def describe(
    uri: str,
    *,
    text_column: str,
    id_columns: list[str],
    s3_endpoint_url: str | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> InputFile:
    """Hash the file and count its rows as the workers will read them (``Reader.count``): a file that is
    not what its extension says, or that lacks a column, fails here, before any row of any file is
    scored. ``on_progress``: told the fraction of the file done as it grows, an increment at a time (the
    passes over a 40 GB file take minutes)."""
    kind = format_of(uri)
    reader = reader_for(kind)
    store, key = split_object_uri(uri, endpoint_url=s3_endpoint_url)
    # An s3:// file's download is a pass of its own, before the reader's.
    progress = Progress(on_progress or (lambda _: None), reader.passes + (not isinstance(store, LocalStore)))

    def hashed(path: str, size: int) -> Source:
        return fingerprint(path, piece_bytes=2**62, on_read=lambda done: progress.at(done, size))

    if isinstance(store, LocalStore):
        source = hashed(uri, store.path(key).stat().st_size)
    else:
        source = copies.hashed_copy(store, key, uri, hashed, on_download=progress)
    progress.end_pass()
    where = Where(uri, s3_endpoint_url, sha256=source.sha256)  # an s3:// file: one copy for it all
    with reader.readable(uri):
        counted = reader.count(where, [text_column, *id_columns], source, progress)
    # The describing process scores nothing: its copy of an s3:// file goes now, not when it exits.
    copies.drop_copy(uri, source.sha256)
    return InputFile(
        uri=uri,
        name=source.name,
        format=kind,
        sha256=source.sha256,
        size=source.size,
        rows=counted.rows,
        offsets=counted.offsets,
        gzip_index=counted.gzip_index,
        gzip=source.gzip,
    )


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
    reader = reader_for(file.format)
    where = Where(file.uri, s3_endpoint_url, sha256=file.sha256, index=file.gzip_index, gzip=file.gzip)
    rows = Rows(start=start, stop=stop, offsets=file.offsets, offsets_from=file.offsets_from)
    kept: list[pa.RecordBatch] = []
    seen = start
    with reader.readable(file.uri):
        for batch in reader.batches(where, [text_column, *id_columns], rows):
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
    """The file's text and id columns as record batches, text first, from row ``start`` on (rows past
    ``stop`` may follow), read by the format's reader (``Reader.batches``). ``offsets``, ``offsets_from``,
    ``gzip_index`` and ``gzip``: as ``InputFile`` holds them; ``sha256``: the file's, where it was
    described, to keep what a read from an offset needs of its start (a CSV's layout, a gzip file's
    index, an s3:// file's copy)."""
    reader = reader_for(kind)
    where = Where(uri, s3_endpoint_url, sha256=sha256, index=gzip_index, gzip=gzip)
    with reader.readable(uri):
        rows = Rows(start=start, stop=stop, offsets=offsets, offsets_from=offsets_from)
        yield from reader.batches(where, [text_column, *id_columns], rows)
