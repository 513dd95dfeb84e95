"""The L1 logistic-regression probe on mLSTM features, and the "sentiment neuron" it singles out.

Radford et al. (2017) fit an L1-regularised logistic regression on the final cell states of a review,
choosing the inverse regularisation strength C on a dev split (their ``train_with_reg_cv``); the L1
penalty drives most of the 4096 weights to zero, and the one with the largest magnitude is a single
unit that alone classifies sentiment almost as well as the whole probe. This module is that recipe on
numpy arrays: ``fit_probe`` sweeps C, refits, and reports the probe and its top unit; ``predict_proba``
is the probe's formula with numpy alone, which the served classifier shares; two plots show the sweep
and the top unit's activations by class (their Fig. 3).

Features are raw cell states, not standardised, as in the paper: the weights then read as per-unit
evidence, and the top unit is the paper's unit. Labels are 0 (negative) and 1 (positive).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from matplotlib.figure import Figure
from scipy.special import entr, expit
from sklearn.linear_model import LogisticRegression

from models.classifier import probability
from models.classifier import top_unit as unit_of
from tasks.transfer.config import ProbeSettings
from tasks.transfer.solvers import DEFAULT_SOLVER, SOLVERS, PathPoint, Solver, liblinear, newton

# The sweep's values of C where a caller gives none: the probe settings' defaults.
DEFAULT_CS: tuple[float, ...] = ProbeSettings().Cs


@dataclass(frozen=True)
class SweepPoint:
    """One C of the sweep: the probe fitted on train, scored on dev, and what the fit cost."""

    C: float
    dev_accuracy: float
    nonzero: int
    # liblinear's objective on train, sum of log-losses + (|w|_1 + |b|) / C: what every solver minimises,
    # so solvers compare by it, not only by accuracy.
    objective: float = float("nan")
    # The fit and its dev scoring, from the previous C's end; not part of the answer, so not compared.
    seconds: float = field(default=0.0, compare=False)
    # False: the solver stopped short of its tolerance (its limit of passes, or no descent left at float
    # precision); the probe is its last point, said on the progress line rather than passed off as solved.
    converged: bool = field(default=True, compare=False)

    def __str__(self) -> str:
        """The progress line of this C."""
        return (
            f"C = {self.C:<10g} dev accuracy {self.dev_accuracy:.4f}  non-zero {self.nonzero:,}  "
            f"{self.seconds:.2f} s"
            + ("" if self.converged else "  (not converged: the solver's tolerance was not reached)")
        )


# eq=False: a generated __eq__ would compare the coef arrays elementwise and fail on the truth value.
@dataclass(frozen=True, eq=False)
class ProbeResult:
    """The probe at the C chosen on dev, its top unit, and the sweep that chose it."""

    C: float
    dev_accuracy: float
    test_accuracy: float
    nonzero: int  # non-zero weights of the refit probe
    top_unit: int  # index of the feature with the largest |weight|
    top_unit_accuracy: float  # test accuracy of that unit alone (1-d logistic fitted on train)
    top_unit_sign: int  # +1 if a high activation means positive
    coef: np.ndarray  # float32 [H]
    intercept: float
    sweep: tuple[SweepPoint, ...]

    def summary(self) -> dict[str, float | int]:
        """The headline numbers as plain Python types, ready for ``json.dumps`` or MLflow metrics."""
        return {
            "test_accuracy": float(self.test_accuracy),
            "dev_accuracy": float(self.dev_accuracy),
            "C": float(self.C),
            "nonzero": int(self.nonzero),
            "top_unit": int(self.top_unit),
            "top_unit_accuracy": float(self.top_unit_accuracy),
        }


def fit_probe(
    train_X: np.ndarray,
    train_y: np.ndarray,
    dev_X: np.ndarray,
    dev_y: np.ndarray,
    test_X: np.ndarray,
    test_y: np.ndarray,
    *,
    Cs: Sequence[float] = DEFAULT_CS,
    seed: int = 0,
    on_fit: Callable[[SweepPoint], None] | None = None,
    solver: Solver = DEFAULT_SOLVER,
    device: str = "cpu",
) -> ProbeResult:
    """Sweeps C on dev, keeps the best probe, and finds its top unit.

    Args:
        train_X, dev_X, test_X: features [N, H] of each split.
        train_y, dev_y, test_y: labels [N] of each split, 0 (negative) or 1 (positive).
        Cs: inverse L1 strengths to try; swept in ascending order whatever the order given.
        seed: liblinear's random_state, so that the same inputs give the same probe.
        on_fit: called with each C's sweep point as soon as it is scored, for progress.
        solver: ``newton`` (warm-started proximal Newton path) or ``liblinear`` (the reference): one of
            ``tasks/transfer/solvers/``.
        device: where the newton solver runs ("cpu", "cuda"); liblinear ignores it.

    Raises:
        ValueError: naming the split, for mismatched shapes, labels other than 0/1, a split holding
            one class only, or non-finite features; or for an empty or non-positive ``Cs``.
    """
    splits = {
        "train": _checked("train", train_X, train_y),
        "dev": _checked("dev", dev_X, dev_y),
        "test": _checked("test", test_X, test_y),
    }
    widths = {name: X.shape[1] for name, (X, _) in splits.items()}
    if len(set(widths.values())) != 1:
        raise ValueError(f"the splits have different numbers of features: {widths}")
    Cs = _checked_cs(Cs)
    (X_tr, y_tr), (X_dev, y_dev), (X_te, y_te) = splits["train"], splits["dev"], splits["test"]

    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")

    sweep: list[SweepPoint] = []
    probes: list[tuple[np.ndarray, float]] = []  # (coef [H] float64, intercept) per C
    started = time.perf_counter()
    for C, fit in zip(Cs, solver_path(solver, X_tr, y_tr, Cs, seed=seed, device=device), strict=True):
        coef_H, intercept = fit.coef, fit.intercept
        point = SweepPoint(
            C=C,
            dev_accuracy=accuracy(coef_H, intercept, X_dev, y_dev),
            nonzero=int(np.count_nonzero(coef_H)),
            objective=objective(coef_H, intercept, X_tr, y_tr, C),
            seconds=time.perf_counter() - started,
            converged=fit.converged,
        )
        sweep.append(point)
        probes.append((coef_H, intercept))
        if on_fit is not None:
            on_fit(point)
        started = time.perf_counter()  # the next C's time excludes what on_fit spent

    # argmax returns the first maximum and Cs ascend, so a tie goes to the smaller C: the more
    # regularised, sparser probe, which is the one more likely to hold up on test.
    best = int(np.argmax([p.dev_accuracy for p in sweep]))
    # The refit on train with the chosen C would repeat this very fit (same data, same random_state,
    # and both solvers are deterministic), so the sweep's model is the refit probe.
    coef, intercept = probes[best]

    top_unit = unit_of(coef)
    # No L1 for one feature: the 1-d fit is a learned threshold on the unit's activation.
    alone = LogisticRegression().fit(X_tr[:, [top_unit]], y_tr)
    alone_weight = float(alone.coef_.ravel()[0])
    # The unit's own direction; the probe's weight decides only if the 1-d fit found none.
    top_unit_sign = 1 if (alone_weight if alone_weight != 0.0 else coef[top_unit]) > 0 else -1

    coef32 = coef.astype(np.float32)
    coef32.setflags(write=False)  # the result is frozen; so is its array
    return ProbeResult(
        C=float(sweep[best].C),
        dev_accuracy=sweep[best].dev_accuracy,
        test_accuracy=accuracy(coef, intercept, X_te, y_te),
        nonzero=sweep[best].nonzero,
        top_unit=top_unit,
        top_unit_accuracy=float(alone.score(X_te[:, [top_unit]], y_te)),
        top_unit_sign=top_unit_sign,
        coef=coef32,
        intercept=float(intercept),
        sweep=tuple(sweep),
    )


def objective(coef_H: np.ndarray, intercept: float, X_NH: np.ndarray, y_N: np.ndarray, C: float) -> float:
    """liblinear's L1 objective divided by C (same minimiser), in float64:
    sum_i log(1 + exp(-s_i (w·x_i + b))) + (|w|_1 + |b|) / C with s_i = ±1."""
    sign_N = 2 * np.asarray(y_N, dtype=np.float64) - 1
    return _objective_of(sign_N * _scores(X_NH, coef_H, intercept), coef_H, intercept, C)


def _objective_of(margin_N: np.ndarray, coef_H: np.ndarray, intercept: float, C: float) -> float:
    """``objective`` from the margins s_i (w·x_i + b)."""
    return float(np.logaddexp(0.0, -margin_N).sum() + (np.abs(coef_H).sum() + abs(intercept)) / C)


def duality_gap(coef_H: np.ndarray, intercept: float, X_NH: np.ndarray, y_N: np.ndarray, C: float) -> float:
    """How far ``objective`` at this probe can be above the minimum over every probe at this C: the
    objective minus the value of a point of its Fenchel dual built from the probe's own residuals (as
    gap-safe screening builds it, Ndiaye et al. 2017). 0 at the minimiser. A certificate: two solvers'
    objectives say which stopped lower, this says how far either can be from the minimum.

    With v = (w, b), z_i = (x_i, 1) and margins m_i = s_i z_i·v, the dual of
    min Σ log(1 + exp(-m_i)) + |v|_1 / C is max Σ h(α_i) over α in [0, 1]^N with
    |Σ α_i s_i z_i|_∞ ≤ 1 / C, h the binary entropy in nats; at the minimiser α_i = σ(-m_i), and the
    probe's own σ(-m_i), scaled down into that box, is such a point."""
    sign_N = 2 * np.asarray(y_N, dtype=np.float64) - 1
    margin_N = sign_N * _scores(X_NH, coef_H, intercept)
    alpha_N = expit(-margin_N)
    weight_N = sign_N * alpha_N
    slope_H = sum(
        (block.T @ weight_N[rows] for rows, block in _float64_blocks(X_NH)), np.zeros(X_NH.shape[1])
    )
    largest = max(float(np.abs(slope_H).max(initial=0.0)), abs(float(weight_N.sum())))
    if C * largest > 1.0:
        alpha_N = alpha_N / (C * largest)
    dual = float((entr(alpha_N) + entr(1.0 - alpha_N)).sum())
    return _objective_of(margin_N, coef_H, intercept, C) - dual


def predict_proba(coef: np.ndarray, intercept: float, X: np.ndarray) -> np.ndarray:
    """P(positive) for each row of X [N, H] under the probe (coef [H], intercept), float64 [N]:
    the served classifier's own formula."""
    return probability(X, coef, intercept)


def plot_sweep(result: ProbeResult, title: str) -> Figure:
    """Dev accuracy against C (log2 axis), the non-zero weight count on a twin axis, the chosen C marked."""
    Cs = [p.C for p in result.sweep]
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(Cs, [p.dev_accuracy for p in result.sweep], "o-", color="tab:blue", label="dev accuracy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("C (inverse L1 strength)")
    ax.set_ylabel("dev accuracy", color="tab:blue")
    ax.axvline(result.C, color="tab:gray", linestyle="--", label=f"chosen C = {result.C:g}")
    twin = ax.twinx()
    twin.plot(Cs, [p.nonzero for p in result.sweep], "s:", color="tab:orange", label="non-zero weights")
    twin.set_ylabel("non-zero weights", color="tab:orange")
    handles, labels = ax.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    ax.legend(handles + twin_handles, labels + twin_labels, loc="lower right")
    ax.set_title(title)
    return fig


def plot_top_unit(result: ProbeResult, X: np.ndarray, y: np.ndarray, title: str) -> Figure:
    """Histogram of the top unit's activation over X [N, H], negatives and positives apart (Fig. 3)."""
    X, y = _checked("plotted", X, y)
    if X.shape[1] != result.coef.shape[0]:
        raise ValueError(f"X has {X.shape[1]} features but the probe has {result.coef.shape[0]}")
    activation = X[:, result.top_unit].astype(np.float64)
    # Shared bins, so the two classes' bars line up and their overlap reads directly.
    bins = np.histogram_bin_edges(activation, bins=50).tolist()
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.hist(activation[y == 0], bins=bins, alpha=0.6, color="tab:red", label="negative")
    ax.hist(activation[y == 1], bins=bins, alpha=0.6, color="tab:blue", label="positive")
    ax.set_xlabel(f"unit {result.top_unit} activation")
    ax.set_ylabel("number of reviews")
    ax.legend()
    ax.set_title(title)
    return fig


def solver_path(
    solver: Solver, X: np.ndarray, y: np.ndarray, Cs: tuple[float, ...], *, seed: int = 0, device: str = "cpu"
) -> Iterator[PathPoint]:
    """The probe at each C of ``Cs`` (ascending) by ``solver``; liblinear takes ``seed``, the others ``device``."""
    if solver == "liblinear":
        return liblinear.l1_logistic_path(X, y, Cs, seed=seed)
    return newton.l1_logistic_path(X, y, Cs, device=device)


def _float64_blocks(X_NH: np.ndarray, rows: int = 1024) -> Iterator[tuple[slice, np.ndarray]]:
    """X's rows in float64, a block at a time, with each block's rows: a whole float64 copy of float32
    features would double the probe's peak memory (737 MB for IMDB's 22,500 × 4,096 train split)."""
    for i in range(0, len(X_NH), rows):
        yield slice(i, i + rows), X_NH[i : i + rows].astype(np.float64)


def _scores(X_NH: np.ndarray, coef_H: np.ndarray, intercept: float) -> np.ndarray:
    """X w + b in float64 (``_float64_blocks``)."""
    return np.concatenate([block @ coef_H + intercept for _, block in _float64_blocks(X_NH)] or [np.zeros(0)])


def accuracy(coef_H: np.ndarray, intercept: float, X: np.ndarray, y: np.ndarray) -> float:
    # scikit-learn's predict: positive where the score is > 0.
    predicted = _scores(X, coef_H, intercept) > 0
    return float((predicted == (y == 1)).mean())


def _checked(name: str, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    X = np.asarray(X)
    y = np.asarray(y)
    if X.ndim != 2:
        raise ValueError(f"{name} features must be 2-d [N, H], got shape {X.shape}")
    if y.ndim != 1:
        raise ValueError(f"{name} labels must be 1-d [N], got shape {y.shape}")
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"{name} has {X.shape[0]} feature rows but {y.shape[0]} labels")
    if not np.issubdtype(X.dtype, np.number) or np.issubdtype(X.dtype, np.complexfloating):
        raise ValueError(f"{name} features must be real numbers, got dtype {X.dtype}")
    if not np.isfinite(X).all():
        raise ValueError(f"{name} features hold NaN or inf ({int((~np.isfinite(X)).sum())} values)")
    classes = np.unique(y)
    if not np.isin(classes, [0, 1]).all():
        raise ValueError(f"{name} labels must be 0 or 1, got {classes[:10].tolist()}")
    if classes.size < 2:
        raise ValueError(f"{name} holds one class only ({classes.tolist()}); a probe needs both")
    return X, y.astype(np.int64)


def _checked_cs(Cs: Sequence[float]) -> tuple[float, ...]:
    values = sorted({float(C) for C in Cs})
    if not values:
        raise ValueError("Cs is empty; give at least one C")
    if not all(np.isfinite(C) and C > 0 for C in values):
        raise ValueError(f"every C must be finite and positive, got {values}")
    return tuple(values)
