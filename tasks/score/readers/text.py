"""Which rows' texts can be scored: a row whose text is empty, not text, not UTF-8 or longer than the
model reads is not an error, but a row written aside with its reason."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


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
    """Each row's text, or None and the reason it cannot be scored (``problems``: a reader's reason for a
    row it could not read, as a JSON-lines line that is not JSON)."""
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
