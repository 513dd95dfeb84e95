"""The sentiment classifier: the mLSTM featurizer and a logistic-regression probe on its features.

    p(positive | text) = σ(c_T · w + b)      c_T: the final cell state after reading the cleaned text

Saved as two files with no pickled code: ``classifier.npz`` (every weight as a named array, loaded
with ``allow_pickle=False``, and each unit's mean per class on the probe's training features, which
``generate --sentiment positive|negative`` holds a unit near) and ``classifier.json`` (the model config, the cleaning, the probe's
provenance). The served MLflow model (``models/serving.py``) is a thin wrapper around this class.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.features import OnBatch, featurize
from models.mlstm import MLSTM, MLSTMConfig
from models.text import CLEANING

WEIGHTS_FILE = "classifier.npz"
CONFIG_FILE = "classifier.json"
LABELS = ("negative", "positive")  # label 0 and label 1
_PROBE_PREFIX = "probe."


class BinaryClassifier:
    """What every served classifier answers: P(positive) per text, and labels from it."""

    info: dict[str, Any]  # where it came from (each subclass's field): the served model reads its limits

    def predict_proba(
        self,
        texts: list[str],
        *,
        batch_size: int = 64,
        precision: str = "auto",
        on_batch: OnBatch | None = None,
    ) -> np.ndarray:
        """P(positive) for each text, in input order; ``on_batch(texts, bytes)`` after each batch read."""
        raise NotImplementedError

    def predict(
        self, texts: list[str], *, batch_size: int = 64, precision: str = "auto"
    ) -> tuple[list[str], np.ndarray]:
        """Labels ("negative"/"positive") and P(positive) for each text, the model read in ``precision``
        (``models.precision.feature_precision``: auto is fp32 on a CPU; bf16 about 3× faster at 1,024
        units on a CPU that has it, probabilities within about 1 % of fp32's)."""
        p_N = self.predict_proba(texts, batch_size=batch_size, precision=precision)
        return labels_of(p_N), p_N


@dataclass
class SentimentClassifier(BinaryClassifier):
    model: MLSTM
    coef_H: np.ndarray
    intercept: float
    info: dict[str, Any] = field(default_factory=dict)  # where it came from: checkpoint, dataset, C, …
    # Each unit's mean on the probe's training features, row 0 the negative class, row 1 the positive;
    # None for a classifier saved before they were kept.
    class_means_2H: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.coef_H = np.asarray(self.coef_H, dtype=np.float32).reshape(-1)
        if self.coef_H.shape != (self.model.config.hidden_size,):
            raise ValueError(
                f"probe has {self.coef_H.shape[0]} weights but the mLSTM has "
                f"{self.model.config.hidden_size} units"
            )
        if self.class_means_2H is not None:
            self.class_means_2H = np.asarray(self.class_means_2H, dtype=np.float32)
            if self.class_means_2H.shape != (2, self.model.config.hidden_size):
                raise ValueError(
                    f"class means have shape {self.class_means_2H.shape}, not (2, "
                    f"{self.model.config.hidden_size})"
                )
        self.model.eval()

    def predict_proba(
        self,
        texts: list[str],
        *,
        batch_size: int = 64,
        precision: str = "auto",
        on_batch: OnBatch | None = None,
    ) -> np.ndarray:
        """P(positive) for each text, in input order."""
        features_NH = featurize(
            self.model, texts, batch_size=batch_size, on_batch=on_batch, precision=precision
        )
        return probability(features_NH, self.coef_H, self.intercept)

    def save(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {name: t.detach().cpu().float().numpy() for name, t in self.model.state_dict().items()}
        arrays[f"{_PROBE_PREFIX}coef"] = self.coef_H
        arrays[f"{_PROBE_PREFIX}intercept"] = np.array([self.intercept], dtype=np.float32)
        if self.class_means_2H is not None:
            arrays[f"{_PROBE_PREFIX}class_means"] = self.class_means_2H
        np.savez(folder / WEIGHTS_FILE, **arrays)
        config = {"model": asdict(self.model.config), "cleaning": CLEANING, "labels": LABELS, **self.info}
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        return folder

    @classmethod
    def load(cls, folder: Path, *, device: torch.device | str = "cpu") -> SentimentClassifier:
        config = read_config(folder)
        with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as arrays:
            state = {k: torch.from_numpy(arrays[k]) for k in arrays.files if not k.startswith(_PROBE_PREFIX)}
            coef_H = arrays[f"{_PROBE_PREFIX}coef"]
            intercept = float(arrays[f"{_PROBE_PREFIX}intercept"][0])
            means = f"{_PROBE_PREFIX}class_means"
            class_means_2H = arrays[means] if means in arrays.files else None
        model = MLSTM(MLSTMConfig(**config.pop("model")))
        model.load_state_dict(state)
        info = {k: v for k, v in config.items() if k not in ("cleaning", "labels")}
        return cls(model.to(device), coef_H, intercept, info, class_means_2H)


def read_config(folder: Path) -> dict[str, Any]:
    """A saved classifier's ``classifier.json``, refused when its text was cleaned otherwise than this
    code cleans it (the weights would read other bytes)."""
    config: dict[str, Any] = json.loads((folder / CONFIG_FILE).read_text())
    if config.get("cleaning") != CLEANING:
        raise ValueError(
            f"{folder / CONFIG_FILE}: the classifier was saved with cleaning {config.get('cleaning')!r}, "
            f"this code applies {CLEANING!r}"
        )
    return config


def probability(features_NH: np.ndarray, coef_H: np.ndarray, intercept: float) -> np.ndarray:
    """P(positive) = σ(features · w + b) [N], in float64 so it matches scikit-learn's predict_proba."""
    logits_N = np.asarray(features_NH, dtype=np.float64) @ np.asarray(coef_H, dtype=np.float64) + float(
        intercept
    )
    return sigmoid(logits_N)


def sigmoid(logits_N: np.ndarray) -> np.ndarray:
    """σ(z) written so that exp never overflows: exp(-|z|) ≤ 1 on both branches."""
    e_N = np.exp(-np.abs(logits_N))
    p_N: np.ndarray = np.where(logits_N >= 0, 1.0 / (1.0 + e_N), e_N / (1.0 + e_N))
    return p_N


def labels_of(p_N: np.ndarray) -> list[str]:
    """ "positive" where P(positive) is at least one half, else "negative"."""
    return [LABELS[int(p >= 0.5)] for p in p_N]


def top_unit(coef_H: np.ndarray) -> int:
    """The sentiment unit: the probe's largest weight in magnitude (the first of a tie)."""
    return int(np.argmax(np.abs(coef_H)))
