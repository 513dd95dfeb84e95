"""Amazon review records → one normalised Arrow table, whichever release wrote them.

The 2014, 2018 and 2023 releases name the same facts differently (``reviewText``/``text``,
``overall``/``rating``, seconds/milliseconds). A block of lines goes through pyarrow's C++ JSON
reader with one explicit schema covering all three; a block it cannot take whole (a bad line, a
loose Python-literal dump, a field of an unexpected type) is parsed line by line, and each line
that still fails becomes a rejected record with its line number and reason.
"""

from __future__ import annotations

import ast
import html
import json
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from models.text import END_PAD, FRONT_PAD, WHITESPACE

# The union of the three releases' fields that the corpus keeps; everything else is ignored.
RAW_SCHEMA = pa.schema(
    [
        ("reviewText", pa.large_string()),
        ("text", pa.large_string()),
        ("overall", pa.float64()),
        ("rating", pa.float64()),
        ("summary", pa.string()),
        ("title", pa.string()),
        ("asin", pa.string()),
        ("reviewerID", pa.string()),
        ("user_id", pa.string()),
        ("unixReviewTime", pa.int64()),
        ("timestamp", pa.int64()),
        ("verified", pa.bool_()),
        ("verified_purchase", pa.bool_()),
        ("vote", pa.string()),
        ("helpful_vote", pa.int64()),
        ("helpful", pa.list_(pa.int64())),
    ]
)

# What a shard holds, in this order.
CORPUS_SCHEMA = pa.schema(
    [
        ("text", pa.large_string()),
        ("rating", pa.float32()),
        ("summary", pa.string()),
        ("product_id", pa.string()),
        ("reviewer_id", pa.string()),
        ("time", pa.timestamp("ms", tz="UTC")),
        ("verified", pa.bool_()),
        ("helpful_votes", pa.int64()),
        ("category", pa.string()),
    ]
)

_READ_OPTIONS_THREADS = False


@dataclass
class Rejects:
    """Rejected lines of one piece: kept whole, with where they came from and why."""

    lines: list[int]
    reasons: list[str]
    raw: list[bytes]

    @classmethod
    def empty(cls) -> Rejects:
        return cls([], [], [])

    def add(self, line: int, reason: str, raw: bytes) -> None:
        self.lines.append(line)
        self.reasons.append(reason)
        self.raw.append(raw)

    def __len__(self) -> int:
        return len(self.lines)


def parse_block(
    data: bytes, first_line: int, rejects: Rejects, num_lines: int | None = None
) -> tuple[pa.Table, np.ndarray]:
    """Parse whole lines into a RAW_SCHEMA table and the 1-based line number of each row.
    ``num_lines`` saves a count when the caller knows it."""
    if num_lines is None:
        num_lines = data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
    table = _parse_fast(data, num_lines)
    if table is not None:
        lines = np.arange(first_line, first_line + table.num_rows, dtype=np.int64)
        return table, lines
    return _parse_slow(data, first_line, rejects)


def _parse_fast(data: bytes, num_lines: int) -> pa.Table | None:
    # Only when rows map one to one onto lines: no blank lines, no carriage returns.
    if not data or data.startswith(b"\n") or b"\n\n" in data or b"\r" in data:
        return None
    try:
        table = pa_json.read_json(
            pa.py_buffer(data),
            read_options=pa_json.ReadOptions(use_threads=_READ_OPTIONS_THREADS, block_size=len(data) + 1),
            parse_options=pa_json.ParseOptions(
                explicit_schema=RAW_SCHEMA, unexpected_field_behavior="ignore"
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != num_lines:
        return None
    try:
        # The JSON reader copies a string's bytes as they are: invalid UTF-8 (raw bytes, an escaped lone
        # surrogate) would reach the shards. Such a block goes line by line, where those lines are rejected.
        table.validate(full=True)
    except pa.ArrowInvalid:
        return None
    return table


def _parse_slow(data: bytes, first_line: int, rejects: Rejects) -> tuple[pa.Table, np.ndarray]:
    records: list[dict[str, object]] = []
    lines: list[int] = []
    for offset, raw in enumerate(data.split(b"\n")):
        line_no = first_line + offset
        stripped = raw.strip()
        if not stripped:
            continue  # a blank line is not a record
        try:
            text = stripped.decode("utf-8")
        except UnicodeDecodeError as error:
            rejects.add(line_no, f"undecodable bytes: not UTF-8 at byte {error.start}", raw)
            continue
        record = _loads(text)
        if isinstance(record, str):
            rejects.add(line_no, record, raw)
            continue
        coerced = _coerce(record)
        if unencodable := _not_utf8(coerced):
            rejects.add(line_no, unencodable, raw)
            continue
        records.append(coerced)
        lines.append(line_no)
    table = pa.Table.from_pylist(records, schema=RAW_SCHEMA)
    return table, np.asarray(lines, dtype=np.int64)


def _loads(text: str) -> dict[str, object] | str:
    """A record, or the reason it is not one. Loose dumps hold Python literals ({'a': 1})."""
    try:
        record = json.loads(text)
    except ValueError as json_error:
        if not text.startswith("{"):
            return f"not JSON: {json_error}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # garbage makes the Python parser warn
                record = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return f"not JSON: {json_error}"
    if not isinstance(record, dict):
        return f"not a JSON object (a {type(record).__name__})"
    return record


def _not_utf8(record: dict[str, object]) -> str | None:
    """Why a record's strings can't be UTF-8 (a JSON ``\\udXXX`` escape of a lone surrogate), or None."""
    for name, value in record.items():
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                return f"undecodable text: {name} holds a lone surrogate at character {error.start}"
    return None


def _coerce(record: dict[str, object]) -> dict[str, object]:
    """Bring one loosely typed record to RAW_SCHEMA's types; what cannot be read becomes null."""
    out: dict[str, object] = {}
    for field in RAW_SCHEMA:
        value = record.get(field.name)
        if value is None:
            continue
        kind = field.type
        try:
            if pa.types.is_string(kind) or pa.types.is_large_string(kind):
                if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                    out[field.name] = str(value)
            elif pa.types.is_floating(kind):
                out[field.name] = float(value)  # type: ignore[arg-type]
            elif pa.types.is_integer(kind):
                number = int(float(str(value).replace(",", "")))
                if -(2**63) <= number < 2**63:  # an int64 column: a bigger one is unreadable, not a crash
                    out[field.name] = number
            elif pa.types.is_boolean(kind):
                out[field.name] = value if isinstance(value, bool) else str(value).lower() == "true"
            elif pa.types.is_list(kind) and isinstance(value, (list, tuple)):
                out[field.name] = [int(v) for v in value]
        except (TypeError, ValueError, OverflowError):
            continue
    return out


def clean_text_column(text: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Vectorised ``models.text.clean_text`` over a column; nulls stay null.

    html.unescape runs in Python only on the rows that contain '&' (a few percent); the rest is
    Arrow compute. The result matches clean_text() exactly (tested on the real files).
    """
    text = pa.chunked_array([text]) if isinstance(text, pa.Array) else text
    text = text.cast(pa.large_string()).combine_chunks()
    escaped = _rows_with_ampersand(text)
    if len(escaped):
        unescaped = [html.unescape(t) for t in text.take(pa.array(escaped)).to_pylist()]
        mask = np.zeros(len(text), dtype=bool)
        mask[escaped] = True
        text = pc.replace_with_mask(text, pa.array(mask), pa.array(unescaped, pa.large_string()))
    text = pc.replace_substring(text, "\n", " ")
    text = pc.utf8_trim(text, characters=WHITESPACE)
    pad = pa.large_string()
    return pc.binary_join_element_wise(
        pa.scalar(FRONT_PAD, pad), text, pa.scalar(END_PAD, pad), pa.scalar("", pad)
    )


def string_buffers(text: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Views of a large_string array's offsets (len + 1, int64) and UTF-8 bytes, without copies:
    row i is ``data[offsets[i]:offsets[i + 1]]``."""
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[text.offset : text.offset + len(text) + 1]
    values = text.buffers()[2]
    data = np.frombuffer(values, dtype=np.uint8) if values is not None else np.zeros(0, dtype=np.uint8)
    return offsets, data


def _rows_with_ampersand(text: pa.LargeStringArray) -> np.ndarray:
    """Indices of the rows that contain '&', found in the data buffer (faster than a substring
    kernel): only those can change under html.unescape."""
    if len(text) == 0:
        return np.zeros(0, dtype=np.int64)
    offsets, data = string_buffers(text)
    positions = np.flatnonzero(data[offsets[0] : offsets[-1]] == ord("&")) + offsets[0]
    rows = np.unique(np.searchsorted(offsets, positions, side="right") - 1)
    if text.null_count:
        rows = rows[text.is_valid().to_numpy(zero_copy_only=False)[rows]]
    return rows


def normalise(raw: pa.Table, category: str) -> pa.Table:
    """One CORPUS_SCHEMA table from a RAW_SCHEMA table of any release (text not yet cleaned)."""
    n = raw.num_rows
    seconds = pc.multiply(raw["unixReviewTime"], 1000)
    vote = pc.replace_substring(raw["vote"], ",", "")
    vote_ok = pc.fill_null(pc.match_substring_regex(vote, r"^\s*\d{1,18}\s*$"), False)
    vote_int = pc.if_else(
        vote_ok, pc.cast(pc.if_else(vote_ok, pc.utf8_trim_whitespace(vote), "0"), pa.int64()), None
    )
    helpful = pc.list_element(
        pc.if_else(pc.greater(pc.list_value_length(raw["helpful"]), 0), raw["helpful"], None), 0
    )
    columns = {
        "text": pc.coalesce(raw["reviewText"], raw["text"]),
        "rating": pc.cast(pc.coalesce(raw["overall"], raw["rating"]), pa.float32()),
        "summary": pc.coalesce(raw["summary"], raw["title"]),
        "product_id": raw["asin"],
        "reviewer_id": pc.coalesce(raw["reviewerID"], raw["user_id"]),
        "time": pc.cast(pc.coalesce(seconds, raw["timestamp"]), pa.timestamp("ms", tz="UTC")),
        "verified": pc.coalesce(raw["verified"], raw["verified_purchase"]),
        "helpful_votes": pc.coalesce(raw["helpful_vote"], vote_int, helpful),
        "category": pa.array([category] * n, pa.string()) if n else pa.array([], pa.string()),
    }
    return pa.table(columns, schema=CORPUS_SCHEMA)
