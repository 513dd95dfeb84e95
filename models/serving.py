"""The classifier as an MLflow pyfunc: a DataFrame with a ``text`` column in, ``label`` and
``probability`` (of positive) out.

MLflow builds it from code (``models/mlflow_model.py``), so the logged model holds no pickle: the
weights are the classifier's ``.npz``, the code is this package (``code_paths``).

Every text is checked before any is scored: a text that is not a string, is empty (or whitespace), or is
longer than the model's ``max_text_chars`` (stored in ``classifier.json`` when the model was logged,
``DEFAULT_MAX_TEXT_CHARS`` for a model logged before) rejects the whole request with one message naming
the row. The recurrence reads a text byte by byte, so a 5 MB text would hold a scoring worker for
minutes; ``mlflow models serve`` answers the rejection with a 400, ``mlstm-sentiment predict`` with
one error line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc.model import PythonModel

from models.classifier import SentimentClassifier

ARTIFACT = "classifier"  # the key of the classifier's folder among the logged model's artifacts
# Above the longest IMDB review (13,704 characters) and SST sentence: no benchmark text is refused, and
# the 4096-unit model reads it in seconds on a CPU.
DEFAULT_MAX_TEXT_CHARS = 20_000
MAX_TEXT_CHARS_KEY = "max_text_chars"  # its key in classifier.json


class TextRejected(MlflowException):
    """A text the model will not score; the scoring server answers it with HTTP 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


class SentimentModel(PythonModel):
    def load_context(self, context: Any) -> None:
        self.classifier = SentimentClassifier.load(Path(context.artifacts[ARTIFACT]))
        self.max_text_chars = int(self.classifier.info.get(MAX_TEXT_CHARS_KEY, DEFAULT_MAX_TEXT_CHARS))

    # pd.DataFrame is the one input hint MLflow takes as is: the logged signature is the schema.
    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        texts = _texts(model_input)
        check_texts(texts, max_text_chars=getattr(self, "max_text_chars", DEFAULT_MAX_TEXT_CHARS))
        batch_size = int((params or {}).get("batch_size", 64))
        labels, p_N = self.classifier.predict(texts, batch_size=batch_size)
        return pd.DataFrame({"label": labels, "probability": p_N})


def _texts(model_input: Any) -> list[Any]:
    """Texts from what MLflow hands over: a DataFrame with a ``text`` column (or one column), a list."""
    if isinstance(model_input, pd.DataFrame):
        if "text" in model_input.columns:
            column = model_input["text"]
        elif len(model_input.columns) == 1:
            column = model_input.iloc[:, 0]
        else:
            raise ValueError(f"expected a 'text' column, got columns {list(model_input.columns)}")
        return list(column)
    if isinstance(model_input, str):
        return [model_input]
    return list(model_input)


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
