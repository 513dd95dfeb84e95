"""What every reader of an input format shares: the interface ``describe`` and ``read_rows`` use, the
span of a file a read covers, and the one error a file that cannot be scored is.

A reader turns a file into Arrow record batches of the text column (text first) and the id columns. It
counts a file's rows when the file is described, and reads a window of rows from where it begins, so
that a piece of a 40 GB file costs its own bytes, not the file's before it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import pyarrow as pa

from tasks.corpus.sources import Source, SourceError

BATCH_ROWS = 4096  # rows per record batch of a JSON-lines or Parquet read
PROBLEM = "_problem"  # a JSON-lines row's reason, when the line itself could not be read


class InputError(SourceError):
    """An input file that cannot be scored as a whole; the message names it and says why."""


@dataclass(frozen=True)
class Where:
    """Where a read of a file begins and ends: the file, its content's sha256 where it was described (an
    s3:// file is then copied once a process, a CSV's layout and a gzip file's index kept), a row's byte
    offset (a gzip file's in its uncompressed stream) and the one it reads up to (None: the file's end),
    the gzip index describing exported, and whether the file is gzip (None: not known, found from its
    first bytes). Parquet and Arrow files seek themselves: they use the file and its sha256 only."""

    uri: str
    s3_endpoint_url: str | None = None
    offset: int = 0
    end: int | None = None
    sha256: str = ""
    index: str = ""
    gzip: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Rows:
    """The rows a read wants: from ``start`` on (rows past ``stop`` may follow), with the file's row
    offsets from index ``offsets_from`` on (``InputFile.offsets``, a window's; empty: from the start)."""

    start: int = 0
    stop: int | None = None
    offsets: tuple[int, ...] = ()
    offsets_from: int = 0


ALL_ROWS = Rows()  # the whole file, from its start


@dataclass(frozen=True, kw_only=True)
class Counted:
    """What describing a file found: its rows, the byte offsets of every ``OFFSET_ROWS``-th row (a line
    format's; empty: read from the start) and a gzip file's exported seek-point index."""

    rows: int
    offsets: tuple[int, ...] = ()
    gzip_index: str = ""


class Progress:
    """A file's describing as the fraction of it done, told to ``report`` as it grows (an increment at a
    time): each pass over the file (the download, the hash, the line scan, the parse) an equal share, a
    pass's share by the bytes or rows it has done of its total."""

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


class Reader(ABC):
    """One input format: how describing counts a file's rows and how a window of them is read."""

    name: ClassVar[str]  # as an error names the format: "CSV", "Parquet"
    passes: ClassVar[int]  # passes over a local file when it is described, the hash's included

    @abstractmethod
    def count(self, where: Where, columns: list[str], source: Source, progress: Progress) -> Counted:
        """The file's rows (and where a window of them begins), read as the workers will read it: a file
        that is not this format, or lacks a column, fails here. ``source``: the file as hashed."""

    @abstractmethod
    def batches(self, where: Where, columns: list[str], rows: Rows = ALL_ROWS) -> Iterator[pa.RecordBatch]:
        """The file's ``columns`` (text first) as record batches from row ``rows.start`` on."""

    @contextlib.contextmanager
    def readable(self, uri: str) -> Iterator[None]:
        """A read that fails is one error naming the file and the format it was read as."""
        try:
            yield
        except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError) as error:
            raise InputError(f"{uri}: not a readable {self.name} file ({error})") from None


def from_row(batches: Iterator[pa.RecordBatch], skip: int) -> Iterator[pa.RecordBatch]:
    """The batches less their first ``skip`` rows."""
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        yield batch.slice(skip) if skip else batch
        skip = 0


def missing(uri: str, names: list[str], columns: list[str]) -> None:
    """Refuse a file without one of ``columns``, naming them and the columns it has."""
    if absent := [c for c in columns if c not in names]:
        raise InputError(
            f"{uri}: no column {', '.join(map(repr, absent))} (it has {', '.join(map(repr, names[:20]))}); "
            "name the text with --text-column and the ids with --id-column"
        )
