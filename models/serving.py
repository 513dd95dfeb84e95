"""The classifier as an MLflow pyfunc: a DataFrame with a ``text`` column in, ``label`` and
``probability`` (of positive) out.

MLflow builds it from code (``models/mlflow_model.py``), so the logged model holds no pickle: the
weights are the classifier's ``.npz``, the code is this package (``code_paths``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.pyfunc.model import PythonModel

from models.classifier import SentimentClassifier

ARTIFACT = "classifier"  # the key of the classifier's folder among the logged model's artifacts


class SentimentModel(PythonModel):
    def load_context(self, context: Any) -> None:
        self.classifier = SentimentClassifier.load(Path(context.artifacts[ARTIFACT]))

    # pd.DataFrame is the one input hint MLflow takes as is: the logged signature is the schema.
    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        texts = _texts(model_input)
        batch_size = int((params or {}).get("batch_size", 64))
        labels, p_N = self.classifier.predict(texts, batch_size=batch_size)
        return pd.DataFrame({"label": labels, "probability": p_N})


def _texts(model_input: Any) -> list[str]:
    """Texts from what MLflow hands over: a DataFrame with a ``text`` column (or one column), a list."""
    if isinstance(model_input, pd.DataFrame):
        if "text" in model_input.columns:
            column = model_input["text"]
        elif len(model_input.columns) == 1:
            column = model_input.iloc[:, 0]
        else:
            raise ValueError(f"expected a 'text' column, got columns {list(model_input.columns)}")
        return [str(t) for t in column]
    if isinstance(model_input, str):
        return [model_input]
    return [str(t) for t in model_input]
