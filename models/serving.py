"""The classifier as an MLflow pyfunc: a DataFrame with a ``text`` column in, ``label`` and
``probability`` (of positive) out.

MLflow loads it through ``models/mlflow_loader.py`` (``loader_module``): the logged model holds no pickle
and no code, only the classifier's ``.npz`` of weights and its ``classifier.json``; the code is the
installed package.

Every text is checked before any is scored: a text that is not a string, is empty (or whitespace), or is
longer than the model's ``max_text_chars`` (stored in ``classifier.json`` when the model was logged,
``DEFAULT_MAX_TEXT_CHARS`` for a model logged before) rejects the whole request with one message naming
the row. The recurrence reads a text byte by byte, so a 5 MB text would hold a scoring worker for
minutes; ``mlflow models serve`` answers the rejection with a 400, ``mlstm-sentiment predict`` with
one error line.

MLflow's scoring server casts the texts of an ``inputs`` or ``instances`` request to the signature's
string type before the model sees them (``5``, ``null``, ``true`` and ``{"a": 1}`` would arrive as
``"5"``, ``"None"``, ``"True"`` and ``"{'a': 1}"`` and be scored), while a ``dataframe_records`` request
keeps them as sent. So the loader module puts ``check_request`` in front of the server's parser
(``guard_scoring_server``): every request format refuses a text that is not a string, naming it.

Two request parameters: ``batch_size`` (rows read at once) and ``precision`` (the dtype the model reads
in, ``models.precision``: auto is fp32 on a CPU; bf16 about 3× faster on a CPU that has it). Both are in
the logged signature (``tasks/transfer/registry.py``): MLflow drops, with a warning, a parameter the
signature lacks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from models.classifier import BinaryClassifier
from models.precision import PRECISION_CHOICES

# Above the longest IMDB review (13,704 characters) and SST sentence: no benchmark text is refused, and
# the 4096-unit model reads it in seconds on a CPU.
DEFAULT_MAX_TEXT_CHARS = 20_000
MAX_TEXT_CHARS_KEY = "max_text_chars"  # its key in classifier.json


# Rows scored at once: memory grows with it, the answer does not.
MAX_BATCH_SIZE = 4096


class TextRejected(MlflowException):
    """A request the model will not score (a text, a parameter); the scoring server answers it with HTTP
    400 and this one message. Any other exception would be a 400 carrying the server's stack trace and
    its paths."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


class SentimentModel:
    """What the loader module gives MLflow: ``predict(model_input, params)`` on a loaded classifier."""

    def __init__(self, classifier: BinaryClassifier) -> None:
        self.classifier = classifier
        self.max_text_chars = int(classifier.info.get(MAX_TEXT_CHARS_KEY, DEFAULT_MAX_TEXT_CHARS))

    def get_raw_model(self) -> SentimentModel:
        """What ``PyFuncModel.get_raw_model`` answers: this, for its ``classifier``."""
        return self

    def predict(self, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        texts = _texts(model_input)
        check_texts(texts, max_text_chars=self.max_text_chars)
        batch_size, precision = _batch_size(params), _precision(params)
        labels, p_N = self.classifier.predict(texts, batch_size=batch_size, precision=precision)
        return pd.DataFrame({"label": labels, "probability": p_N})


def _texts(model_input: Any) -> list[Any]:
    """Texts from what MLflow hands over: a DataFrame with a ``text`` column (or one column), a list."""
    if isinstance(model_input, pd.DataFrame):
        if "text" in model_input.columns:
            column = model_input["text"]
        elif len(model_input.columns) == 1:
            column = model_input.iloc[:, 0]
        else:
            raise TextRejected(f"expected a 'text' column, got columns {list(model_input.columns)!r:.200}")
        return list(column)
    if isinstance(model_input, str):
        return [model_input]
    return list(model_input)


def _batch_size(params: dict[str, Any] | None) -> int:
    value = (params or {}).get("batch_size", 64)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH_SIZE:
        raise TextRejected(
            f"params: 'batch_size' must be a whole number from 1 to {MAX_BATCH_SIZE}, got {value!r:.40}"
        )
    return value


def _precision(params: dict[str, Any] | None) -> str:
    """The products' dtype (``models.precision``): auto (fp32 on a CPU, bf16 or fp16 on a GPU) or a name."""
    value = (params or {}).get("precision", "auto")
    if value not in PRECISION_CHOICES:
        raise TextRejected(
            f"params: 'precision' must be one of {', '.join(PRECISION_CHOICES)}, got {value!r:.40}"
        )
    return str(value)


def check_texts(texts: list[Any], *, max_text_chars: int) -> None:
    """Raise ``TextRejected`` naming the first row (from 1) that is not a non-empty string within the limit."""
    for row, text in enumerate(texts, start=1):
        if not isinstance(text, str):
            raise TextRejected(f"row {row}: 'text' must be a string, got {type(text).__name__} {text!r:.40}")
        if not text.strip():
            raise TextRejected(f"row {row}: 'text' is empty; give each text some words")
        if len(text) > max_text_chars:
            raise TextRejected(
                f"row {row}: 'text' has {len(text):,} characters, more than this model's limit of "
                f"{max_text_chars:,} (max_text_chars, set by MLSTM_MAX_TEXT_CHARS when it was logged)"
            )


def check_request(request: dict[str, Any], *, column: str = "text") -> None:
    """Raise ``TextRejected`` naming the first text of an ``inputs`` or ``instances`` request, as sent,
    that is not a string (the other formats reach ``check_texts`` as sent)."""
    for key in ("inputs", "instances"):
        if key in request:
            for row, text in enumerate(_sent_texts(request[key], column), start=1):
                if text is not _ABSENT and not isinstance(text, str):
                    raise TextRejected(
                        f"{key}: row {row}: '{column}' must be a string, got {type(text).__name__} {text!r:.40}"
                    )


_ABSENT = object()  # a record without the column: MLflow's schema refuses it by name


def _sent_texts(value: Any, column: str) -> list[Any]:
    """The texts of a request's ``inputs``/``instances`` value: a column (``{"text": [...]}`` or one
    text), records (``[{"text": ...}]``), or the texts themselves (``[...]`` or one text)."""
    if isinstance(value, dict):
        value = value.get(column, [])
        return value if isinstance(value, list) else [value]
    if not isinstance(value, list):
        return [value]
    if value and all(isinstance(item, dict) for item in value):
        return [item.get(column, _ABSENT) for item in value]
    return value


def guard_scoring_server() -> None:
    """Put ``check_request`` in front of MLflow's scoring server's parser, in a process that runs one (the
    server imports it before it loads the model); elsewhere nothing. Once per process."""
    server = sys.modules.get("mlflow.pyfunc.scoring_server")
    parse: Callable[..., Any] | None = getattr(server, "infer_and_parse_data", None)
    if server is None or parse is None or getattr(parse, "checks_texts", False):
        return

    def parse_checked(data: Any, schema: Any = None) -> Any:
        if isinstance(data, dict):
            check_request(data)
        return parse(data, schema)

    parse_checked.checks_texts = True  # type: ignore[attr-defined]
    server.infer_and_parse_data = parse_checked  # type: ignore[attr-defined]
