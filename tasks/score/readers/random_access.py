"""Random-access formats (Parquet, Arrow IPC): read from a local file (an s3:// one from the process's
copy), a window from the row group or record batch holding its first row; no offsets to record."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from tasks.corpus.sources import Source
from tasks.score.readers import base, copies
from tasks.score.readers.base import ALL_ROWS, Counted, Progress, Reader, Rows, Where, from_row, missing


class RandomAccessReader(Reader):
    """A format that seeks itself: describing reads it through once to count its rows."""

    passes = 2  # the hash, the read

    def count(self, where: Where, columns: list[str], source: Source, progress: Progress) -> Counted:
        total = self.stated_rows(where)
        rows = 0
        for batch in self.batches(where, columns):
            rows += batch.num_rows
            progress.at(rows, total)
        progress.end_pass()
        return Counted(rows=rows)

    def stated_rows(self, where: Where) -> int | None:
        """The rows the file says it has, to tell a read's progress against (None: told at its end)."""
        return None

    def batches(self, where: Where, columns: list[str], rows: Rows = ALL_ROWS) -> Iterator[pa.RecordBatch]:
        with copies.local(where.uri, where.s3_endpoint_url, where.sha256) as path:
            yield from self.local_batches(where.uri, path, columns, rows.start)

    @abstractmethod
    def local_batches(self, uri: str, path: str, columns: list[str], start: int) -> Iterator[pa.RecordBatch]:
        """The ``columns`` of the local file ``path`` (``uri``'s, to name it) from row ``start`` on."""


class ParquetReader(RandomAccessReader):
    name = "Parquet"

    def stated_rows(self, where: Where) -> int | None:
        """The rows the file's footer states."""
        import pyarrow.parquet as pq

        with (
            copies.local(where.uri, where.s3_endpoint_url, where.sha256) as path,
            pq.ParquetFile(path) as parquet,
        ):
            return int(parquet.metadata.num_rows)

    def local_batches(self, uri: str, path: str, columns: list[str], start: int) -> Iterator[pa.RecordBatch]:
        """From the row group holding ``start``: the groups before it are not decoded."""
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as parquet:
            missing(uri, parquet.schema_arrow.names, columns)
            group_rows = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
            group, first = 0, 0
            while group < len(group_rows) - 1 and first + group_rows[group] <= start:
                first += group_rows[group]
                group += 1
            groups = range(group, len(group_rows))
            batches = parquet.iter_batches(columns=columns, batch_size=base.BATCH_ROWS, row_groups=groups)
            yield from from_row(batches, start - first)


class ArrowReader(RandomAccessReader):
    """An Arrow IPC file, memory-mapped (its read is quick: progress told at its end), or stream."""

    name = "Arrow IPC"

    def local_batches(self, uri: str, path: str, columns: list[str], start: int) -> Iterator[pa.RecordBatch]:
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
            missing(uri, reader.schema.names, columns)
            for batch in from_row(batches, start):
                yield batch.select(columns)
