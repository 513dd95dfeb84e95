"""The L1 probe and its top unit on synthetic features where one known unit carries the label."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from tasks.transfer.probe import (
    DEFAULT_CS,
    ProbeResult,
    SweepPoint,
    fit_probe,
    plot_sweep,
    plot_top_unit,
    predict_proba,
)

NUM_FEATURES = 64
SENTIMENT_UNIT = 17
SIZES = {"train": 600, "dev": 200, "test": 400}


def _split(rng: np.random.Generator, n: int, sign: float) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, 2, size=n)
    X = rng.normal(size=(n, NUM_FEATURES)).astype(np.float32)
    # One unit carries the label, well above the noise (accuracy alone ≈ Φ(1.5 / 0.8) ≈ 0.97).
    X[:, SENTIMENT_UNIT] = sign * (2 * y - 1) * 1.5 + rng.normal(scale=0.8, size=n)
    return X, y


def _data(sign: float = 1.0, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {name: _split(rng, n, sign) for name, n in SIZES.items()}


def _args(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    return [a for name in ("train", "dev", "test") for a in data[name]]


@pytest.fixture(scope="module")
def data() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return _data()


@pytest.fixture(scope="module")
def result(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> ProbeResult:
    # Any FutureWarning (a deprecated sklearn spelling) or ConvergenceWarning fails the fit here.
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", ConvergenceWarning)
        warnings.simplefilter("error", UserWarning)
        return fit_probe(*_args(data), solver="liblinear")


def test_the_probe_finds_the_sentiment_unit(result: ProbeResult) -> None:
    assert result.test_accuracy > 0.9
    assert result.top_unit == SENTIMENT_UNIT
    assert result.top_unit_accuracy > 0.9
    assert result.top_unit_sign == 1
    assert 0 < result.nonzero < 20
    assert result.coef.dtype == np.float32 and result.coef.shape == (NUM_FEATURES,)
    assert result.C in DEFAULT_CS


def test_the_sweep_covers_every_C_in_ascending_order(result: ProbeResult) -> None:
    assert [p.C for p in result.sweep] == sorted(DEFAULT_CS)
    assert all(isinstance(p, SweepPoint) for p in result.sweep)
    # A weaker penalty keeps more weights (only the ends compared: L1 paths need not be monotone).
    assert result.sweep[0].nonzero < result.sweep[-1].nonzero
    chosen = next(p for p in result.sweep if p.C == result.C)
    assert chosen.dev_accuracy == result.dev_accuracy == max(p.dev_accuracy for p in result.sweep)
    assert chosen.nonzero == result.nonzero


def test_a_tie_on_dev_goes_to_the_smaller_C(result: ProbeResult) -> None:
    best = max(p.dev_accuracy for p in result.sweep)
    # The unit is strong enough that several Cs reach the same dev accuracy: a real tie to break.
    assert sum(p.dev_accuracy == best for p in result.sweep) > 1
    tied = [p.C for p in result.sweep if p.dev_accuracy == best]
    assert min(tied) == result.C


def test_summary_has_exactly_the_headline_keys_and_is_json(result: ProbeResult) -> None:
    summary = result.summary()
    assert set(summary) == {"test_accuracy", "dev_accuracy", "C", "nonzero", "top_unit", "top_unit_accuracy"}
    assert json.loads(json.dumps(summary)) == summary
    assert type(summary["nonzero"]) is int and type(summary["top_unit"]) is int
    assert type(summary["test_accuracy"]) is float


def test_a_negatively_correlated_unit_has_sign_minus_one() -> None:
    result = fit_probe(*_args(_data(sign=-1.0)), solver="liblinear")
    assert result.top_unit == SENTIMENT_UNIT
    assert result.top_unit_sign == -1
    assert result.coef[SENTIMENT_UNIT] < 0
    assert result.top_unit_accuracy > 0.9


def test_on_fit_reports_each_point_of_the_sweep(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    seen: list[SweepPoint] = []
    Cs = (1.0, 2.0**-8, 0.25)
    result = fit_probe(*_args(data), Cs=Cs, on_fit=seen.append, solver="liblinear")
    assert tuple(seen) == result.sweep
    assert [p.C for p in seen] == sorted(Cs)


def test_predict_proba_matches_sklearn(
    result: ProbeResult, data: dict[str, tuple[np.ndarray, np.ndarray]]
) -> None:
    X_tr, y_tr = data["train"]
    X_te, _ = data["test"]
    reference = LogisticRegression(
        C=result.C, l1_ratio=1.0, solver="liblinear", max_iter=1000, random_state=0
    )
    reference.fit(X_tr, y_tr)
    np.testing.assert_array_equal(result.coef, reference.coef_.ravel().astype(np.float32))
    ours = predict_proba(result.coef, result.intercept, X_te)
    np.testing.assert_allclose(ours, reference.predict_proba(X_te)[:, 1], rtol=0, atol=1e-6)
    assert ((ours > 0.5) == (reference.predict(X_te) == 1)).mean() > 0.99


def test_predict_proba_does_not_overflow_on_large_logits() -> None:
    p = predict_proba(np.array([1.0], dtype=np.float32), 0.0, np.array([[-1e4], [0.0], [1e4]]))
    np.testing.assert_array_equal(p, [0.0, 0.5, 1.0])


def test_the_same_inputs_give_the_same_probe(
    result: ProbeResult, data: dict[str, tuple[np.ndarray, np.ndarray]]
) -> None:
    again = fit_probe(*_args(data), solver="liblinear")
    assert again.summary() == result.summary()
    assert again.sweep == result.sweep
    assert again.intercept == result.intercept and again.top_unit_sign == result.top_unit_sign
    np.testing.assert_array_equal(again.coef, result.coef)


def test_a_split_with_one_class_is_refused(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    args = _args(data)
    args[3] = np.ones_like(args[3])  # dev_y
    with pytest.raises(ValueError, match=r"^dev holds one class only"):
        fit_probe(*args)


def test_labels_other_than_0_1_are_refused(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    args = _args(data)
    args[1] = args[1] * 2 - 1  # train_y in {-1, 1}
    with pytest.raises(ValueError, match=r"^train labels must be 0 or 1"):
        fit_probe(*args)


@pytest.mark.parametrize(
    ("index", "replace", "message"),
    [
        (4, lambda a: a[:-1], r"^test has 399 feature rows but 400 labels"),
        (2, lambda a: a[:, :-1], r"different numbers of features"),
        (0, lambda a: a[0], r"^train features must be 2-d"),
    ],
)
def test_mismatched_shapes_are_refused(
    data: dict[str, tuple[np.ndarray, np.ndarray]], index: int, replace, message: str
) -> None:
    args = _args(data)
    args[index] = replace(args[index])
    with pytest.raises(ValueError, match=message):
        fit_probe(*args)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_features_are_refused(data: dict[str, tuple[np.ndarray, np.ndarray]], bad: float) -> None:
    args = _args(data)
    args[2] = args[2].copy()  # dev_X
    args[2][5, 3] = bad
    with pytest.raises(ValueError, match=r"^dev features hold NaN or inf \(1 values\)"):
        fit_probe(*args)


@pytest.mark.parametrize("Cs", [(), (0.0, 1.0), (-1.0,), (float("inf"),)])
def test_bad_Cs_are_refused(data: dict[str, tuple[np.ndarray, np.ndarray]], Cs: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match=r"Cs is empty|finite and positive"):
        fit_probe(*_args(data), Cs=Cs, solver="liblinear")


def _no_pyplot_figures() -> None:
    pyplot = pytest.importorskip("matplotlib.pyplot")
    assert pyplot.get_fignums() == []


def test_plot_sweep_draws_accuracy_and_sparsity(result: ProbeResult, tmp_path: Path) -> None:
    fig = plot_sweep(result, "synthetic")
    ax, twin = fig.axes
    assert ax.get_xlabel() == "C (inverse L1 strength)"
    assert ax.get_ylabel() == "dev accuracy"
    assert twin.get_ylabel() == "non-zero weights"
    assert ax.get_xscale() == "log"
    assert ax.get_title() == "synthetic"
    path = tmp_path / "sweep.png"
    fig.savefig(path)
    assert path.stat().st_size > 0
    _no_pyplot_figures()


def test_plot_top_unit_draws_both_classes(
    result: ProbeResult, data: dict[str, tuple[np.ndarray, np.ndarray]], tmp_path: Path
) -> None:
    X_te, y_te = data["test"]
    fig = plot_top_unit(result, X_te, y_te, "synthetic")
    (ax,) = fig.axes
    assert ax.get_xlabel() == f"unit {SENTIMENT_UNIT} activation"
    assert ax.get_ylabel() == "number of reviews"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["negative", "positive"]
    path = tmp_path / "top_unit.png"
    fig.savefig(path)
    assert path.stat().st_size > 0
    _no_pyplot_figures()


def test_plot_top_unit_refuses_features_of_another_width(
    result: ProbeResult, data: dict[str, tuple[np.ndarray, np.ndarray]]
) -> None:
    X_te, y_te = data["test"]
    with pytest.raises(ValueError, match="features but the probe has"):
        plot_top_unit(result, X_te[:, :10], y_te, "synthetic")


def _c_matters(seed: int = 3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Few train rows, many noise units: the smallest C keeps no weight (chance), a middle C keeps the
    sentiment unit, the largest Cs fit the noise too. Dev accuracy then has one clear peak."""
    rng = np.random.default_rng(seed)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 2, size=n)
        X = rng.normal(size=(n, NUM_FEATURES)).astype(np.float32)
        X[:, SENTIMENT_UNIT] = (2 * y - 1) * 0.6 + rng.normal(scale=0.8, size=n)
        return X, y

    return {"train": split(40), "dev": split(400), "test": split(400)}


def test_C_is_the_dev_argmax_and_the_test_labels_play_no_part() -> None:
    data = _c_matters()
    result = fit_probe(*_args(data), solver="liblinear")
    dev = [p.dev_accuracy for p in result.sweep]
    assert result.sweep[0].nonzero == 0  # the smallest C leaves no weight: C matters here
    assert result.C == result.sweep[int(np.argmax(dev))].C != result.sweep[0].C, result.sweep
    assert result.dev_accuracy == max(dev)
    # The test accuracy is the probe's own, measured here on the test split, and not the dev one.
    X_te, y_te = data["test"]
    assert result.test_accuracy == float(
        ((predict_proba(result.coef, result.intercept, X_te) > 0.5) == y_te).mean()
    )
    assert result.test_accuracy != result.dev_accuracy

    inverted = fit_probe(*_args({**data, "test": (X_te, 1 - y_te)}), solver="liblinear")
    # Inverted test labels turn the test accuracy around and change nothing else: C is chosen on dev.
    assert inverted.C == result.C and inverted.dev_accuracy == result.dev_accuracy
    assert inverted.test_accuracy == pytest.approx(1 - result.test_accuracy)
    np.testing.assert_array_equal(inverted.coef, result.coef)
