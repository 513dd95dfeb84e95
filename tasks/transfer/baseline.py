"""The measured baseline a probe is compared with: TF-IDF n-grams and logistic regression, on the same splits.

Features: word 1-2-grams and char 2-5-grams (``char``: across word boundaries too), each TF-IDF with
sublinear tf and min_df 2, fitted on train only (a kind with no term in two train texts, e.g. words
when no word repeats, is left out). Classifier: scikit-learn's L2 logistic regression
(liblinear), C swept over ``DEFAULT_CS`` (powers of 2 from 2^-4 to 2^6) and chosen by dev accuracy (ties go to
the smaller C), the dataset's own dev rule deciding what dev is. Test accuracy is
reported for the chosen C only, so the test split never influences the choice.

The papers' figures for this kind of baseline are citations (see docs/transfer.md); this is the measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.sparse import csr_matrix, hstack
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from tasks.transfer.datasets import Dataset, DatasetError, Split

# What the numbers mean, in words: the transfer stage keys its cache by it, so a change here measures again.
METHOD = (
    "TF-IDF word 1-2-grams + char 2-5-grams (sublinear tf, min_df 2, fitted on train), L2 logistic "
    "regression (liblinear), C in 2^-4..2^6 chosen on dev (ties to the smaller), test accuracy of that C"
)
# Powers of 2, as the probe's sweep: a coarser grid (0.25, 1, 4, …) left SST's dev choice at its edge.
DEFAULT_CS = tuple(2.0**k for k in range(-4, 7))


@dataclass(frozen=True)
class BaselineResult:
    """What ``fit_baseline`` measured: accuracies of the chosen C, and how long the whole fit took."""

    test_accuracy: float
    dev_accuracy: float
    C: float
    seconds: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def fit_baseline(
    dataset: Dataset,
    *,
    Cs: Sequence[float] = DEFAULT_CS,
    on_C: Callable[[float, float], None] | None = None,
) -> BaselineResult:
    """Fit the TF-IDF baseline on ``dataset``'s train split, choose C on dev, report test accuracy.

    ``on_C(C, dev_accuracy)`` hears each C of the sweep as it is scored.

    Raises DatasetError naming the dataset's source for a split that is empty or holds one class only.
    """
    start = time.perf_counter()
    for name, split in dataset.splits().items():
        _check_split(dataset.source, name, split)
    if not Cs or any(not np.isfinite(c) or c <= 0 for c in Cs):
        raise ValueError(f"baseline: Cs must be positive numbers, got {list(Cs)}")
    vectorizers = [
        TfidfVectorizer(analyzer="word", ngram_range=(1, 2), sublinear_tf=True, min_df=2),
        TfidfVectorizer(analyzer="char", ngram_range=(2, 5), sublinear_tf=True, min_df=2),
    ]
    fitted = []
    for vectorizer in vectorizers:
        try:
            fitted.append((vectorizer, vectorizer.fit_transform(dataset.train.texts)))
        except ValueError as error:  # min_df left no terms: too few train texts share a word n-gram
            if "no terms remain" not in str(error) and "empty vocabulary" not in str(error):
                raise
    if not fitted:
        raise DatasetError(
            f"{dataset.source}: no word or character n-gram occurs in two train texts; "
            "the TF-IDF baseline has no terms to fit"
        )
    vectorizers = [v for v, _ in fitted]
    train_X = csr_matrix(hstack([X for _, X in fitted]))
    dev_X = csr_matrix(hstack([v.transform(dataset.dev.texts) for v in vectorizers]))
    test_X = csr_matrix(hstack([v.transform(dataset.test.texts) for v in vectorizers]))
    best: tuple[float, float, LogisticRegression] | None = None
    for C in sorted(Cs):
        model = LogisticRegression(C=C, solver="liblinear", max_iter=1000).fit(train_X, dataset.train.labels)
        dev_accuracy = float((model.predict(dev_X) == dataset.dev.labels).mean())
        if on_C is not None:
            on_C(float(C), dev_accuracy)
        if best is None or dev_accuracy > best[0]:  # strict: a tie keeps the smaller C
            best = (dev_accuracy, C, model)
    assert best is not None
    dev_accuracy, C, model = best
    test_accuracy = float((model.predict(test_X) == dataset.test.labels).mean())
    return BaselineResult(test_accuracy, dev_accuracy, float(C), time.perf_counter() - start)


def _check_split(source: str, name: str, split: Split) -> None:
    if len(split) == 0:
        raise DatasetError(
            f"{source}: the {name} split is empty; the baseline needs rows in train, dev and test"
        )
    if name != "test" and len(np.unique(split.labels)) < 2:
        raise DatasetError(f"{source}: the {name} split holds one class only; the baseline needs both labels")
