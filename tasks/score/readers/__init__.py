"""The readers of the input formats ``score`` takes, one type each, chosen once by a file's format
(``formats.FORMATS``): line formats read in windows by byte offset (``lines``: CSV, JSON lines, plain or
gzip), random-access formats read from their row group or record batch (``random_access``: Parquet,
Arrow IPC)."""

from __future__ import annotations

from tasks.score.readers.base import Reader
from tasks.score.readers.csv_file import CsvReader
from tasks.score.readers.json_lines import JsonLinesReader
from tasks.score.readers.random_access import ArrowReader, ParquetReader

READERS: dict[str, Reader] = {
    "csv": CsvReader(),
    "jsonl": JsonLinesReader(),
    "parquet": ParquetReader(),
    "arrow": ArrowReader(),
}


def reader_for(format: str) -> Reader:
    """The reader of a format named in ``formats.FORMATS``."""
    return READERS[format]
