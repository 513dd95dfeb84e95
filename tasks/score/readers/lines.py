"""Line formats (CSV, JSON lines; plain or gzip), read in windows by byte offset.

Describing scans a file's lines once, recording the byte offset of every ``OFFSET_ROWS``-th row (a gzip
file's in its uncompressed stream, through a seek-point index it exports for the workers); a window of
rows is then read from the offset at or before its first row up to the one at or after its last, so
reading all of a file's windows costs about one reading of it, not one per window. A window's bytes are
read into memory alone (pyarrow's CSV reader reads tens of blocks ahead of the rows taken, so a stream
would cost a worker the file after its window); a plain s3:// file's by a ranged GET of its own bytes,
a gzip one's from the process's copy (``copies``).
"""

from __future__ import annotations

import contextlib
import gzip
import io
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import IO, ClassVar

import pyarrow as pa

from tasks.corpus.sources import GZIP_MAGIC, Source
from tasks.score.readers import copies
from tasks.score.readers.base import ALL_ROWS, Counted, Progress, Reader, Rows, Where, from_row
from tasks.score.readers.gzip_index import export_index, new_index, read_range
from tasks.store import LocalStore, split_object_uri

# Windows start at multiples of piece_rows × WINDOW_PIECES (16,384 by default), so on an offset.
OFFSET_ROWS = 1024
SCAN_REPORT_BYTES = 8 * 2**20  # of lines between two reports of a line scan's progress


class LineReader(Reader):
    """A format of rows in lines: scanned for its row offsets when described, read by windows."""

    passes = 3  # the hash, the line scan, the parse
    # CSV: a header line first, and a row ends at a line end outside quotes; JSON lines: a row a line.
    quoted_rows: ClassVar[bool]

    def count(self, where: Where, columns: list[str], source: Source, progress: Progress) -> Counted:
        """The line scan's offsets and rows, then the rows as the format's parser counts them
        (``parsed_rows``), read whole where it cannot say: a file whose parse disagrees with its scan
        keeps no offsets, its windows read from its start."""
        scanned = scan(
            where, quoted_rows=self.quoted_rows, on_read=lambda done: progress.at(done, source.size)
        )
        progress.end_pass()
        rows = self.parsed_rows(where, columns, scanned, source, progress)
        if rows is None:
            rows = 0
            for batch in self.batches(where, columns):
                rows += batch.num_rows
                progress.at(rows, scanned.rows)
        progress.end_pass()
        if scanned.rows != rows:  # the line scan and pyarrow disagree on this CSV (a lone \r line end)
            return Counted(rows=rows)
        return scanned

    @abstractmethod
    def parsed_rows(
        self, where: Where, columns: list[str], scanned: Counted, source: Source, progress: Progress
    ) -> int | None:
        """The rows the format's parser finds, checked against the line scan's (``scanned``: its rows,
        offsets and gzip index); None where only a read from the start can say."""

    def batches(self, where: Where, columns: list[str], rows: Rows = ALL_ROWS) -> Iterator[pa.RecordBatch]:
        start, stop, offsets, offsets_from = rows.start, rows.stop, rows.offsets, rows.offsets_from
        # Indexes into the file's offsets; ``offsets`` begin at index ``offsets_from`` (a window's).
        stored = offsets_from + len(offsets)
        index = min(start // OFFSET_ROWS, stored - 1) if offsets else -1
        first, offset = (index * OFFSET_ROWS, offsets[index - offsets_from]) if index > 0 else (0, 0)
        last = -(-stop // OFFSET_ROWS) if stop is not None and offsets else stored
        end = offsets[last - offsets_from] if last < stored else None  # None: to the file's end
        window = Where(where.uri, where.s3_endpoint_url, offset, end, where.sha256, where.index, where.gzip)
        yield from from_row(self.window_batches(window, columns), start - first)

    @abstractmethod
    def window_batches(self, where: Where, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """The rows between ``where.offset`` and ``where.end`` (the file's start: with its header)."""


def scan(where: Where, *, quoted_rows: bool, on_read: Callable[[int], None] = lambda _: None) -> Counted:
    """The byte offsets of rows 0, OFFSET_ROWS, 2·OFFSET_ROWS, … of a CSV or JSON-lines file (a gzip
    file's in its uncompressed stream), and the rows it has, by one scan of its lines: a JSON-lines row is
    a line that is not blank (as its reader reads), a CSV row (``quoted_rows``) a record after the header,
    ending at a line end outside quotes (an even count of ``"`` so far: RFC 4180, as pyarrow reads it),
    empty lines skipped. A gzip file is scanned through a seek-point index, exported for the workers. ``on_read``: told the bytes of the file read so far
    (a gzip file's compressed bytes), every ``SCAN_REPORT_BYTES`` of its lines."""
    offsets: list[int] = []
    rows = 0
    index = ""
    with copies.local(where.uri, where.s3_endpoint_url, where.sha256) as path, open(path, "rb") as raw:
        packed = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        with new_index(raw) if packed else contextlib.nullcontext(raw) as stream:
            position, header, quoted = 0, quoted_rows, False
            report = SCAN_REPORT_BYTES
            for line in stream:
                begins, position = position, position + len(line)
                if position >= report:
                    on_read(raw.tell())
                    report = position + SCAN_REPORT_BYTES
                if not quoted_rows:
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
                index = export_index(stream, where.sha256)
    return Counted(rows=rows, offsets=tuple(offsets), gzip_index=index)


@contextlib.contextmanager
def opened(where: Where) -> Iterator[IO[bytes]]:
    """The file's bytes from ``where.offset``, gunzipped when they are gzip (by their magic bytes, as the
    corpus reads). A window that ends before the file does (``end``) is its bytes alone, in memory. A gzip
    window past the file's start is read through the process's index of the file (``read_range``); a
    plain s3:// file's window by a ranged GET (``_ranged_window``)."""
    if (window := _ranged_window(where)) is not None:
        yield io.BytesIO(window)
        return
    with copies.local(where.uri, where.s3_endpoint_url, where.sha256) as path, open(path, "rb") as raw:
        packed = raw.read(2) == GZIP_MAGIC
        raw.seek(0 if packed else where.offset)
        if packed and where.offset:
            yield io.BytesIO(read_range(path, where.sha256, where.offset, where.end, where.index))
        elif packed:
            with gzip.GzipFile(fileobj=raw) as unzipped:
                yield unzipped if where.end is None else io.BytesIO(unzipped.read(where.end))  # type: ignore[misc]
        else:
            yield raw if where.end is None else io.BytesIO(raw.read(where.end - where.offset))


def _ranged_window(where: Where) -> bytes | None:
    """The bytes of a window of a plain s3:// file by a ranged GET, where this process holds no copy of
    it: a copy a process would cost each worker the whole object (8 workers scoring a 40 GB CSV: 320 GB
    downloaded, and 40 GB of disk each). None where the read needs the copy: a gzip file (read through
    its index) or one not known to be plain, the whole file, or a file this process has copied."""
    if where.gzip is not False or (not where.offset and where.end is None):
        return None
    store, key = split_object_uri(where.uri, endpoint_url=where.s3_endpoint_url)
    if isinstance(store, LocalStore) or copies.holds_copy(where.uri, where.sha256):
        return None
    with contextlib.closing(store.open_read(key, start=where.offset)) as body:
        return body.read() if where.end is None else body.read(where.end - where.offset)
