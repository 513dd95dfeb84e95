"""The tables a scoring run reads: CSV, JSON lines (gzip too), Parquet and Arrow IPC, local or s3://.

Finding the files and hashing them are the corpus stage's own (``tasks.corpus.sources``); an s3://
file is read from a local copy (Parquet and Arrow need random access). Here a file is read as a sequence of Arrow record batches holding the text
column and the id columns only. A row whose text cannot be scored (empty, not text, not UTF-8, longer
than the model reads) is not an error: ``texts_of`` says why, and the run writes it aside. A file that
cannot be read as its extension says, or lacks the text column, is one ``InputError`` naming it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import pyarrow as pa

from tasks.corpus.sources import GZIP_MAGIC, SourceError, expand_sources, fingerprint
from tasks.score.formats import FORMATS, SUFFIXES
from tasks.store import split_object_uri

BATCH_ROWS = 4096  # rows per record batch read from a JSON-lines file
CSV_BLOCK_BYTES = 16 * 2**20  # pyarrow infers a CSV's column types from its first block


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


def describe(
    uri: str, *, text_column: str, id_columns: list[str], s3_endpoint_url: str | None = None
) -> InputFile:
    """Hash the file and count its rows by reading it once: a file that is not what its extension
    says, or that lacks a column, fails here, before any row of any file is scored."""
    source = fingerprint(uri, piece_bytes=2**62, s3_endpoint_url=s3_endpoint_url)
    kind = format_of(uri)
    rows = sum(
        batch.num_rows
        for batch in read_batches(
            uri, kind, text_column=text_column, id_columns=id_columns, s3_endpoint_url=s3_endpoint_url
        )
    )
    return InputFile(
        uri=uri, name=source.name, format=kind, sha256=source.sha256, size=source.size, rows=rows
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
    """Rows ``[start, stop)`` of the file (text and id columns), streamed: memory holds a batch."""
    kept: list[pa.RecordBatch] = []
    seen = 0
    for batch in read_batches(
        file.uri, file.format, text_column=text_column, id_columns=id_columns, s3_endpoint_url=s3_endpoint_url
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
) -> Iterator[pa.RecordBatch]:
    """The file's text and id columns as record batches, text first. CSV and JSON lines carry the text
    as bytes (``binary``), so one row of bad UTF-8 is that row's problem, not the file's."""
    columns = [text_column, *id_columns]
    try:
        if kind == "csv":
            yield from _csv_batches(uri, columns, s3_endpoint_url)
        elif kind == "jsonl":
            yield from _jsonl_batches(uri, columns, s3_endpoint_url)
        else:
            with _local(uri, s3_endpoint_url) as path:
                yield from (_parquet_batches if kind == "parquet" else _arrow_batches)(uri, path, columns)
    except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError) as error:
        raise InputError(f"{uri}: not a readable {_FORMAT_NAMES[kind]} file ({error})") from None


_FORMAT_NAMES = {"csv": "CSV", "jsonl": "JSON-lines", "parquet": "Parquet", "arrow": "Arrow IPC"}


def _missing(uri: str, names: list[str], columns: list[str]) -> None:
    if absent := [c for c in columns if c not in names]:
        raise InputError(
            f"{uri}: no column {', '.join(map(repr, absent))} (it has {', '.join(map(repr, names[:20]))}); "
            "name the text with --text-column and the ids with --id-column"
        )


@contextlib.contextmanager
def _opened(uri: str, s3_endpoint_url: str | None) -> Iterator[IO[bytes]]:
    """The file's bytes, gunzipped when they are gzip (by their magic bytes, as the corpus reads)."""
    with _local(uri, s3_endpoint_url) as path, open(path, "rb") as raw:
        if raw.read(2) == GZIP_MAGIC:
            raw.seek(0)
            with gzip.GzipFile(fileobj=raw) as unzipped:
                yield unzipped  # type: ignore[misc]
        else:
            raw.seek(0)
            yield raw


def _csv_batches(uri: str, columns: list[str], s3_endpoint_url: str | None) -> Iterator[pa.RecordBatch]:
    import pyarrow.csv as pacsv

    with _opened(uri, s3_endpoint_url) as stream:
        # The header alone first, to name a missing column before pyarrow's own error does.
        header = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES))
        _missing(uri, header.schema.names, columns)
    with _opened(uri, s3_endpoint_url) as stream:
        reader = pacsv.open_csv(
            stream,
            read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
            convert_options=pacsv.ConvertOptions(
                include_columns=columns, column_types={columns[0]: pa.binary()}
            ),
        )
        yield from reader


def _jsonl_batches(uri: str, columns: list[str], s3_endpoint_url: str | None) -> Iterator[pa.RecordBatch]:
    """One record a line; a line that is not a JSON object keeps its row (its text is null, with the
    reason in ``_problem``) so that row numbers stay line numbers of records. A file with no object
    holding the text field is no JSON-lines table of reviews: one error."""
    text, ids = columns[0], columns[1:]
    found = False
    with _opened(uri, s3_endpoint_url) as stream:
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
        raise InputError(f"{uri}: no record has a {text!r} field; name the text with --text-column")


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
def _local(uri: str, s3_endpoint_url: str | None) -> Iterator[str]:
    """A local path of the file (an s3:// one copied for the block): Parquet and Arrow are read by random
    access."""
    store, key = split_object_uri(uri, endpoint_url=s3_endpoint_url)
    with store.local_copy(key) as path:
        yield str(path)


def _parquet_batches(uri: str, path: str, columns: list[str]) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as parquet:
        _missing(uri, parquet.schema_arrow.names, columns)
        yield from parquet.iter_batches(columns=columns, batch_size=BATCH_ROWS)


def _arrow_batches(uri: str, path: str, columns: list[str]) -> Iterator[pa.RecordBatch]:
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
        for batch in batches:
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
