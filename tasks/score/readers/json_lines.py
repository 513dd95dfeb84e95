"""JSON-lines files (plain or gzip): one record a line. A line that is not a JSON object keeps its row
(its text is null, the reason in the ``PROBLEM`` column) so that row numbers stay line numbers of
records; texts go in as bytes, like a CSV's."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.corpus.sources import Source
from tasks.score.readers import base, copies, lines
from tasks.score.readers.base import PROBLEM, Counted, InputError, Progress, Where
from tasks.score.readers.lines import LineReader

GZIP_CHECK_BYTES = 16 * 2**20  # of a gzip file's text read at a time to check it is whole


class JsonLinesReader(LineReader):
    name = "JSON-lines"
    quoted_rows = False

    def parsed_rows(
        self, where: Where, columns: list[str], scanned: Counted, source: Source, progress: Progress
    ) -> int | None:
        """The scan's rows: the scan counts a line that is not blank as a row, whatever it holds, as the
        reading does. What is left to know is that the file holds reviews (some record has the text
        field, ``_check_text_field``) and that a gzip file is whole (``_check_gzip``); parsing every
        line here would take three quarters of describing."""
        _check_text_field(where, columns[0])
        if source.gzip:
            _check_gzip(where, lambda done: progress.at(done, source.size))
        return scanned.rows

    def window_batches(self, where: Where, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """A file with no object holding the text field is no JSON-lines table of reviews: one error
        (read from its start)."""
        text, ids = columns[0], columns[1:]
        found = where.offset > 0
        with lines.opened(where) as stream:
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
                if len(problems) == base.BATCH_ROWS:
                    yield _batch(values, problems, text)
                    values, problems = {name: [] for name in columns}, []
            if problems:
                yield _batch(values, problems, text)
        if not found:
            raise _no_text_field(where.uri, text)


def _check_gzip(where: Where, on_read: Callable[[int], None]) -> None:
    """Read a gzip file through to its end, every member's CRC and length checked: the line scan's
    ``indexed_gzip`` stops without an error where a file is cut short, and would count the rows
    before the cut. ``on_read``: told the compressed bytes read so far."""
    with (
        copies.local(where.uri, where.s3_endpoint_url, where.sha256) as path,
        open(path, "rb") as raw,
        gzip.GzipFile(fileobj=raw) as unzipped,
    ):
        while unzipped.read(GZIP_CHECK_BYTES):
            on_read(raw.tell())


def _no_text_field(uri: str, text: str) -> InputError:
    return InputError(f"{uri}: no record has a {text!r} field; name the text with --text-column")


def _check_text_field(where: Where, text: str) -> None:
    """A JSON-lines file is a table of reviews when some record holds the text field: read up to the
    first that does (its first line, as a rule), not the whole file."""
    with lines.opened(where) as stream:
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


def _batch(values: dict[str, list[Any]], problems: list[str | None], text: str) -> pa.RecordBatch:
    reasons = [
        problem or (None if isinstance(v, bytes) else f"not text ({v.type_name})")
        for v, problem in zip(values[text], problems, strict=True)
    ]
    texts = pa.array([v if isinstance(v, bytes) else None for v in values[text]], type=pa.binary())
    ids = {name: pa.array(column) for name, column in values.items() if name != text}
    return pa.record_batch({text: texts, **ids, PROBLEM: pa.array(reasons, type=pa.string())})
