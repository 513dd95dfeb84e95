"""CSV files (plain or gzip), read by pyarrow with the text as bytes (``binary``): one row of bad UTF-8
is that row's problem, not the file's. A window past the header is parsed with the header's names and
the column types pyarrow inferred from the file's first block, as a read from the start has them."""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator
from typing import IO, Any

import pyarrow as pa
import pyarrow.csv as pacsv

from tasks.corpus.sources import Source
from tasks.score.readers import lines
from tasks.score.readers.base import Counted, Progress, Where, missing
from tasks.score.readers.lines import OFFSET_ROWS, LineReader

CSV_BLOCK_BYTES = 16 * 2**20  # pyarrow infers a CSV's column types from its first block
# A quoted value may hold line ends (a review's paragraphs, RFC 4180, as the line scan counts them). By
# default pyarrow cuts its blocks at any line end, so a block that began inside such a value fails the
# file ("CSV parser got out of sync with chunker").
_PARSE = pacsv.ParseOptions(newlines_in_values=True)

Layout = tuple[tuple[str, ...], tuple[tuple[str, pa.DataType], ...]]  # header names, column types


class CsvReader(LineReader):
    name = "CSV"
    quoted_rows = True

    def parsed_rows(
        self, where: Where, columns: list[str], scanned: Counted, source: Source, progress: Progress
    ) -> int | None:
        """The rows, counted by pyarrow one window at a time (about two blocks, between the line scan's
        offsets), each window's bytes alone in memory and parsed as a worker parses them: the whole
        stream handed to pyarrow is read up to 32 blocks ahead of the rows parsed. None where the file
        has no offsets, or a window does not hold the rows the scan counted in it, or cannot be parsed:
        the caller then reads the stream whole, which names the error."""
        offsets, total = scanned.offsets, scanned.rows
        if not offsets:
            return None
        names, types = _layout(where, columns)
        first = 0
        windows: list[tuple[int, int]] = []
        for i, offset in enumerate(offsets):
            if offset - offsets[first] >= 2 * CSV_BLOCK_BYTES:
                windows.append((first, i))
                first = i
        windows.append((first, len(offsets)))
        with lines.opened(where) as stream:
            for first, last in windows:
                begin = offsets[first] if first else 0  # the first window holds the header
                data = stream.read(offsets[last] - begin) if last < len(offsets) else stream.read()
                expected = (
                    (last - first) * OFFSET_ROWS if last < len(offsets) else total - first * OFFSET_ROWS
                )
                try:
                    reader = _csv_reader(pa.BufferReader(data), begin, names, types, columns)
                    if sum(batch.num_rows for batch in reader) != expected:
                        return None
                except (pa.ArrowException, UnicodeDecodeError):
                    return None
                progress.at(first * OFFSET_ROWS + expected, total)  # the rows counted so far
        return total

    def window_batches(self, where: Where, columns: list[str]) -> Iterator[pa.RecordBatch]:
        names, types = _layout(where, columns)
        with lines.opened(where) as stream:
            yield from _csv_reader(stream, where.offset, names, types, columns)


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


def _layout(where: Where, columns: list[str]) -> Layout:
    """The file's ``_csv_layout``, from its first blocks only: the file's start up to twice a block (not
    streamed, which would read tens of blocks ahead, ``lines.opened``)."""
    layout = _csv_layout if where.sha256 else _csv_layout.__wrapped__  # kept by content only
    first = Where(
        where.uri, where.s3_endpoint_url, end=2 * CSV_BLOCK_BYTES, sha256=where.sha256, gzip=where.gzip
    )
    return layout(first, tuple(columns))


@functools.lru_cache(maxsize=4)
def _csv_layout(start: Where, columns: tuple[str, ...]) -> Layout:
    """A CSV's header names and its columns' types as pyarrow reads them from the start (the types it
    infers from the first block). Kept by the file's content: a worker needs it for each window."""
    with lines.opened(start) as stream:
        first = stream.read()  # ``start`` ends after the first blocks: read once for both readers
    # The header alone first, to name a missing column before pyarrow's own error does.
    header = pacsv.open_csv(
        io.BytesIO(first), read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES), parse_options=_PARSE
    )
    missing(start.uri, header.schema.names, list(columns))
    reader = pacsv.open_csv(
        io.BytesIO(first),
        read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
        parse_options=_PARSE,
        convert_options=pacsv.ConvertOptions(
            include_columns=list(columns), column_types={columns[0]: pa.binary()}
        ),
    )
    return tuple(header.schema.names), tuple((f.name, f.type) for f in reader.schema)
