"""The probe solvers against liblinear, the reference: same accuracies, same C, deterministic; on synthetic
and on real features; and the `probe` command on feature files."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

from tasks.transfer.features import features_table
from tasks.transfer.probe import DEFAULT_CS, ProbeResult, fit_probe
from tasks.transfer.solvers import Solver, newton, quadratic

Data = dict[str, tuple[np.ndarray, np.ndarray]]


def _sparse_problem(width: int, seed: int = 0) -> Data:
    """Correlated, unequally scaled columns (as cell states are) whose labels depend on 8 of them."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((32, width)) / 4
    scale_H = rng.uniform(0.2, 3.0, width)
    w_true = np.zeros(width)
    w_true[:8] = rng.choice([-2.0, 2.0], 8)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        X = np.tanh(rng.standard_normal((n, 32)) @ mixing + 0.5 * rng.standard_normal((n, width))) * scale_H
        y = (rng.random(n) < 1 / (1 + np.exp(-(X @ w_true)))).astype(np.int64)
        return X.astype(np.float32), y

    return {"train": split(2000), "dev": split(500), "test": split(800)}


# liblinear's objective is the goal: newton's may exceed it by no more than float64 sums over 10⁴ rows
# can tell apart (benchmarks/probe.py checks the same).
OBJECTIVE_SLACK = 1e-7


def _badly_scaled(width: int, rows: tuple[int, int, int], seed: int = 0) -> Data:
    """Columns sharing 64 factors with little noise of their own (0.05) and log-normal scales (σ = 2: a
    few columns thousands of times larger than others), labels from 8 of them before scaling: the
    conditioning of real cell states, which made the solver no faster than liblinear before."""
    rng = np.random.default_rng(seed)
    mixing = (rng.standard_normal((64, width)) / 4).astype(np.float32)
    scale_H = rng.lognormal(0.0, 2.0, width).astype(np.float32)
    w_true = rng.choice([-2.0, 2.0], 8)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        T = np.tanh(
            rng.standard_normal((n, 64)).astype(np.float32) @ mixing
            + 0.05 * rng.standard_normal((n, width)).astype(np.float32)
        )
        y = (rng.random(n) < 1 / (1 + np.exp(-(T[:, :8] @ w_true)))).astype(np.int64)
        return T * scale_H, y

    return dict(zip(("train", "dev", "test"), map(split, rows), strict=True))


def _near_low_rank(width: int, rows: tuple[int, int, int], rank: int = 8, seed: int = 0) -> Data:
    """Columns a tanh of the same ``rank`` latent factors plus noise of 0.05 after it, scaled log-normally
    (σ = 1), labels from a sparse direction in the latent: a trained model's strongly correlated cell
    states (benchmarks/probe.py's RANK cases), on which a working set's Hessian has about ``rank`` large
    eigenvalues over a floor of noise."""
    rng = np.random.default_rng(seed)
    mixing = (rng.standard_normal((rank, width)) / np.sqrt(rank)).astype(np.float32)
    scale_H = rng.lognormal(0.0, 1.0, width).astype(np.float32)
    w_true = rng.choice([-1.5, 1.5], 4)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        Z = rng.standard_normal((n, rank)).astype(np.float32)
        T = np.tanh(Z @ mixing) + 0.05 * rng.standard_normal((n, width)).astype(np.float32)
        y = (rng.random(n) < 1 / (1 + np.exp(-(Z[:, :4] @ w_true)))).astype(np.int64)
        return T * scale_H, y

    return dict(zip(("train", "dev", "test"), map(split, rows), strict=True))


def _assert_objectives_at_most_liblinears(ours: ProbeResult, theirs: ProbeResult) -> None:
    gaps = {
        p.C: (p.objective - q.objective) / q.objective for p, q in zip(ours.sweep, theirs.sweep, strict=True)
    }
    assert max(gaps.values()) <= OBJECTIVE_SLACK, gaps


def _fit(data: Data, solver: str, Cs: tuple[float, ...] = DEFAULT_CS) -> ProbeResult:
    return fit_probe(*data["train"], *data["dev"], *data["test"], Cs=Cs, solver=solver)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def data() -> Data:
    return _sparse_problem(256)


@pytest.fixture(scope="module")
def reference(data: Data) -> ProbeResult:
    return _fit(data, "liblinear")


@pytest.fixture(scope="module", params=["newton"])
def fast(data: Data, request: pytest.FixtureRequest) -> ProbeResult:
    return _fit(data, request.param)


def test_newton_matches_liblinear_at_every_C(data: Data, reference: ProbeResult) -> None:
    # liblinear converges at every C on this problem, so the two minimisers must agree everywhere.
    ours = _fit(data, "newton")
    for point, theirs in zip(ours.sweep, reference.sweep, strict=True):
        assert point.C == theirs.C
        assert abs(point.dev_accuracy - theirs.dev_accuracy) <= 0.005, (point, theirs)
    assert ours.C == reference.C and abs(ours.test_accuracy - reference.test_accuracy) <= 0.005
    _assert_objectives_at_most_liblinears(ours, reference)
    X, y = data["train"]
    again = list(newton.l1_logistic_path(X, y, DEFAULT_CS))
    assert all(p.converged for p in again), [(p.C, p.iterations) for p in again]
    # A second run on the same inputs gives the same probe, bit for bit.
    chosen = next(p for p in again if p.C == ours.C)
    np.testing.assert_array_equal(chosen.coef.astype(np.float32), ours.coef)
    assert chosen.intercept == ours.intercept


def test_dev_accuracy_matches_liblinear_at_every_C(reference: ProbeResult, fast: ProbeResult) -> None:
    for ours, theirs in zip(fast.sweep, reference.sweep, strict=True):
        assert ours.C == theirs.C
        assert abs(ours.dev_accuracy - theirs.dev_accuracy) <= 0.005, (ours, theirs)


def test_the_chosen_C_is_liblinears_or_ties_on_dev(reference: ProbeResult, fast: ProbeResult) -> None:
    theirs = {p.C: p.dev_accuracy for p in reference.sweep}
    assert fast.C == reference.C or abs(theirs[fast.C] - reference.dev_accuracy) <= 0.005
    assert abs(fast.test_accuracy - reference.test_accuracy) <= 0.005


def test_the_known_sparse_answer_is_found(fast: ProbeResult) -> None:
    # The labels depend on columns 0-7 only: the strongest weight is one of them.
    assert fast.top_unit < 8
    assert 0 < fast.nonzero < 256


def test_the_same_inputs_give_the_same_probe(
    data: Data, fast: ProbeResult, request: pytest.FixtureRequest
) -> None:
    again = _fit(data, request.node.callspec.params["fast"])
    np.testing.assert_array_equal(again.coef, fast.coef)
    assert again.intercept == fast.intercept and again.sweep == fast.sweep


def test_a_model_the_sweeps_cannot_solve_makes_the_rest_of_the_path_float64_and_active_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first model stops at the sweeps' cap: it and every later one, at this C and the larger ones
    # after, are solved on a float64 matrix by the active-set method, and the path still ends at
    # liblinear's objective.
    data = _badly_scaled(64, (400, 50, 50))
    sweeps_on: list[np.dtype] = []
    active_on: list[np.dtype] = []
    sweep, active = quadratic.model_minimiser, quadratic.active_set_minimiser

    def capped_once(hessian: np.ndarray, *args: object, **kwargs: object) -> tuple[np.ndarray, int]:
        sweeps_on.append(hessian.dtype)
        d, sweeps = sweep(hessian, *args, **kwargs)  # type: ignore[arg-type]
        return d, quadratic.MAX_SWEEPS if len(sweeps_on) == 1 else sweeps

    def watched(hessian: np.ndarray, *args: object, **kwargs: object) -> tuple[np.ndarray, int]:
        active_on.append(hessian.dtype)
        return active(hessian, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(newton, "model_minimiser", capped_once)
    monkeypatch.setattr(newton, "active_set_minimiser", watched)
    Cs = (0.25, 1.0, 4.0)
    ours = _fit(data, "newton", Cs)
    assert sweeps_on == [np.float32]  # the first model only: never swept again along the path
    assert len(active_on) >= len(Cs) and set(active_on) == {np.dtype(np.float64)}
    assert all(p.converged for p in ours.sweep)
    _assert_objectives_at_most_liblinears(ours, _fit(data, "liblinear", Cs))


def test_where_float32_sums_round_past_the_tolerance_every_C_still_converges() -> None:
    # 20,000 rows and log-normal scales (σ = 2): a float32 gradient entry rounds past the tolerance from
    # C = 1 on (float32 sums throughout left C ≥ 2 unconverged, up to 300 times the tolerance).
    rng = np.random.default_rng(0)
    mixing = (rng.standard_normal((16, 32)) / 4).astype(np.float32)
    T = np.tanh(
        rng.standard_normal((20000, 16)).astype(np.float32) @ mixing
        + 0.05 * rng.standard_normal((20000, 32)).astype(np.float32)
    )
    y = (rng.random(20000) < 1 / (1 + np.exp(-(T[:, :4] @ np.array([2.0, -2.0, 2.0, -2.0]))))).astype(
        np.int64
    )
    X = T * rng.lognormal(0.0, 2.0, 32).astype(np.float32)
    s = y * 2.0 - 1
    for point in newton.l1_logistic_path(X, y, tuple(2.0**c for c in range(-2, 7))):
        scores = X.astype(np.float64) @ point.coef + point.intercept
        r = -s / (1 + np.exp(s * scores))  # d loss / d score, exactly
        lam = 1 / point.C
        worst = max(
            quadratic.min_subgradient(X.T.astype(np.float64) @ r, point.coef, lam).max(),
            quadratic.min_subgradient(np.array([r.sum()]), np.array([point.intercept]), lam)[0],
        )
        assert point.converged and worst <= newton.TOL * lam * 1.01, (point.C, worst / (newton.TOL * lam))


def test_an_extrapolation_that_would_raise_the_model_is_refused() -> None:
    # Without L1 the model's minimiser is w - H⁻¹g. With it as the last iterate and random points
    # before, any other combination of the iterates is higher on the model: the guard must keep the last.
    rng = np.random.default_rng(0)
    A = rng.standard_normal((60, 40))
    hessian = (A.T @ A).astype(np.float32)
    g, w, lam = rng.standard_normal(40), np.zeros(40), np.zeros(40)
    best = -np.linalg.solve(hessian.astype(np.float64), g)
    us = np.vstack([rng.standard_normal((5, 40)), best])
    hds = us @ hessian.T.astype(np.float64)
    u, hd = us[-1].copy(), hds[-1].copy()
    assert not quadratic.extrapolate(us, hds, g, w, lam, u, hd)
    np.testing.assert_array_equal(u, best)
    # The same iterates ending anywhere else: the extrapolation lands lower, and is kept.
    us[-1] = rng.standard_normal(40)
    hds = us @ hessian.T.astype(np.float64)
    u, hd = us[-1].copy(), hds[-1].copy()
    assert quadratic.extrapolate(us, hds, g, w, lam, u, hd)
    assert quadratic.model_value(u, hd, g, w, lam) < quadratic.model_value(us[-1], hds[-1], g, w, lam)


def test_a_pass_whose_line_search_finds_no_descent_ends_the_C_unconverged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every step an ascent direction: the line search halves to float precision and keeps the point.
    # The next pass would find that same point and step, so the C must stop there, said unconverged,
    # not repeat it for the rest of its passes.
    rng = np.random.default_rng(0)
    X = rng.standard_normal((500, 20)).astype(np.float32)
    s_N = torch.from_numpy(np.where(rng.random(500) < 0.5, -1.0, 1.0))
    XT = torch.from_numpy(np.ascontiguousarray(X.T))
    monkeypatch.setattr(newton, "model_minimiser", lambda hessian, g, w, lam, target, **_: (g.copy(), 0))
    w_H, b, _, steps, converged = newton._solve(
        XT,
        XT.double(),
        s_N,
        np.zeros(20),
        0.0,
        torch.zeros(500, dtype=torch.float64),
        0.01,
        1e-6,
        50,
        newton._LazyHessian(),
        newton._Workspace(),
    )
    assert not converged and steps == 1, steps
    assert not w_H.any() and b == 0.0


def test_an_unconverged_C_says_so_on_its_progress_line(monkeypatch: pytest.MonkeyPatch) -> None:
    X, y = _badly_scaled(64, (200, 20, 20))["train"]

    def lines() -> list[str]:
        said: list[str] = []
        fit_probe(
            X, y, X, y, X, y, Cs=(0.01, 4.0), solver="newton", on_fit=lambda point: said.append(str(point))
        )
        return said

    assert not any("not converged" in line for line in lines())
    cut_short = functools.partial(newton.l1_logistic_path, max_outer=1)  # one pass: short of the tolerance
    monkeypatch.setattr(newton, "l1_logistic_path", cut_short)
    assert all("not converged" in line for line in lines())


def test_the_extrapolated_start_along_the_path_saves_newton_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # Badly scaled, correlated columns; the large-C half of the path, where the solutions move most.
    X, y = _badly_scaled(256, (1000, 10, 10))["train"]
    Cs = DEFAULT_CS[4:]
    extrapolated = list(newton.l1_logistic_path(X, y, Cs))
    monkeypatch.setattr(newton, "_extrapolated_start", lambda XT_HN, s_N, C, start, solved: start)
    plain = list(newton.l1_logistic_path(X, y, Cs))
    steps, plain_steps = (sum(p.iterations for p in path) for path in (extrapolated, plain))
    assert steps * 1.1 <= plain_steps, (steps, plain_steps)
    assert all(p.converged for p in extrapolated)


def test_an_extrapolated_start_that_would_raise_the_objective_is_refused() -> None:
    # The line through the solutions at C and 2C, followed to 4C, and the same line turned back on
    # itself (the solution at 2C given as the earlier one): only the first lowers 4C's objective.
    X, y = _badly_scaled(64, (500, 10, 10))["train"]
    XT_HN = torch.from_numpy(np.ascontiguousarray(X.T))
    s_N = torch.from_numpy(y * 2.0 - 1)
    (w1, b1), (w2, b2) = ((p.coef, p.intercept) for p in newton.l1_logistic_path(X, y, (0.25, 0.5)))
    start = (w2, b2, (XT_HN.T.double() @ torch.from_numpy(w2)) + b2)
    w_H, b, z_N = newton._extrapolated_start(XT_HN, s_N, 1.0, start, [(w1, b1, 0.25), (w2, b2, 0.5)])
    assert not np.array_equal(w_H, w2)  # taken, with its own scores
    scores = X.astype(np.float64) @ w_H + b
    np.testing.assert_allclose(z_N.numpy(), scores, atol=1e-5 * np.abs(scores).max())
    backwards = newton._extrapolated_start(
        XT_HN, s_N, 1.0, start, [(2 * w2 - w1, 2 * b2 - b1, 0.25), (w2, b2, 0.5)]
    )
    assert backwards is start


def test_the_duality_gap_bounds_how_far_a_probe_is_above_the_minimum(data: Data) -> None:
    """``duality_gap``: about 0 near the minimiser (liblinear at tol 1e-8), and at a probe stopped short
    (tol 1e-2) at least how far its objective is above the minimum, so above the tight fit's: a bound that
    holds for any solver's answer."""
    from sklearn.linear_model import LogisticRegression

    from tasks.transfer.probe import duality_gap, objective

    X, y = data["train"]
    for C in (0.01, 0.1, 1.0):
        fits = [
            LogisticRegression(C=C, l1_ratio=1.0, solver="liblinear", tol=tol, max_iter=100_000).fit(X, y)
            for tol in (1e-8, 1e-2)
        ]
        (best, best_gap), (short, short_gap) = (
            (objective(*args, X, y, C), duality_gap(*args, X, y, C))
            for args in ((f.coef_.ravel().astype(np.float64), float(f.intercept_[0])) for f in fits)
        )
        assert 0 <= best_gap <= 1e-6 * best, (C, best_gap)
        assert short_gap >= short - best > 0, (C, short, best, short_gap)


def test_the_duality_gap_holds_where_the_intercepts_row_binds() -> None:
    """The dual constraint has a row for the intercept (liblinear penalises it too): on labels nine to one
    and features near zero, the probe at zero is far from the minimum almost only through its intercept,
    and its gap must still bound that distance."""
    from sklearn.linear_model import LogisticRegression

    from tasks.transfer.probe import duality_gap, objective

    rng = np.random.default_rng(3)
    X = rng.normal(scale=0.01, size=(400, 20)).astype(np.float32)
    y = (rng.random(400) < 0.9).astype(np.int64)
    C = 1.0
    tight = LogisticRegression(C=C, l1_ratio=1.0, solver="liblinear", tol=1e-10, max_iter=100_000).fit(X, y)
    minimum = objective(tight.coef_.ravel().astype(np.float64), float(tight.intercept_[0]), X, y, C)
    zero = np.zeros(X.shape[1])
    assert duality_gap(zero, 0.0, X, y, C) >= objective(zero, 0.0, X, y, C) - minimum > 0


def test_an_unknown_solver_is_refused(data: Data) -> None:
    with pytest.raises(ValueError, match="solver must be one of liblinear, newton"):
        _fit(data, "saga")


WIDE_CS = DEFAULT_CS[:6]  # 2^-8 … 2^-3: liblinear's large-C end alone takes minutes at this width


@pytest.fixture(scope="module")
def wide() -> tuple[Data, ProbeResult]:
    """A 4096-wide problem whose labels depend on columns 0-7 (a known sparse answer), and liblinear's probe."""
    data = _sparse_problem(4096, seed=1)
    return data, _fit(data, "liblinear", WIDE_CS)


@pytest.mark.slow
def test_a_4096_wide_problem_matches_liblinear(wide: tuple[Data, ProbeResult], one_thread: None) -> None:
    data, reference = wide
    fast = _fit(data, "newton", WIDE_CS)
    for ours, theirs in zip(fast.sweep, reference.sweep, strict=True):
        assert abs(ours.dev_accuracy - theirs.dev_accuracy) <= 0.005, (ours, theirs)
    dev_of = {p.C: p.dev_accuracy for p in reference.sweep}
    assert fast.C == reference.C or abs(dev_of[fast.C] - reference.dev_accuracy) <= 0.005
    assert abs(fast.test_accuracy - reference.test_accuracy) <= 0.005
    assert fast.top_unit < 8 and reference.top_unit < 8  # the known answer, found by both


@pytest.mark.slow
def test_on_badly_scaled_correlated_features_newtons_objective_is_liblinears_at_every_C() -> None:
    data = _badly_scaled(512, (2000, 500, 500))
    reference, ours = _fit(data, "liblinear"), _fit(data, "newton")
    _assert_objectives_at_most_liblinears(ours, reference)
    assert abs(ours.test_accuracy - reference.test_accuracy) <= 0.005


def test_on_near_low_rank_features_newton_is_at_the_minimum_at_every_C() -> None:
    """At every C of the default sweep newton converges, stops no higher than liblinear, and its duality
    gap certifies it within 0.02 % of the minimum: a working set or stopping rule that left out a feature
    the minimiser needs (a screening rule discarding an active feature) leaves it above."""
    from tasks.transfer.probe import duality_gap, objective
    from tasks.transfer.solvers import liblinear

    X, y = _near_low_rank(128, (1500, 300, 300))["train"]
    theirs = list(liblinear.l1_logistic_path(X, y, DEFAULT_CS))
    for ours, reference in zip(newton.l1_logistic_path(X, y, DEFAULT_CS), theirs, strict=True):
        value = objective(ours.coef, ours.intercept, X, y, ours.C)
        assert ours.converged, ours.C
        assert value <= objective(reference.coef, reference.intercept, X, y, ours.C) * (1 + OBJECTIVE_SLACK)
        assert duality_gap(ours.coef, ours.intercept, X, y, ours.C) <= 2e-4 * value, ours.C


@pytest.mark.long  # liblinear alone takes about a minute at 4,096 features up to C = 2^-2
def test_at_4096_features_badly_scaled_newtons_objective_is_liblinears_up_to_a_large_C(
    one_thread: None,
) -> None:
    data = _badly_scaled(4096, (3000, 500, 500), seed=1)
    Cs = DEFAULT_CS[:7]  # … 2^-2: past 2^-3, where the working sets reach a thousand columns
    reference, ours = _fit(data, "liblinear", Cs), _fit(data, "newton", Cs)
    _assert_objectives_at_most_liblinears(ours, reference)
    assert abs(ours.test_accuracy - reference.test_accuracy) <= 0.005


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_gives_the_cpus_accuracies(
    data: Data, fast: ProbeResult, request: pytest.FixtureRequest
) -> None:
    solver = request.node.callspec.params["fast"]
    on_gpu = fit_probe(*data["train"], *data["dev"], *data["test"], solver=solver, device="cuda")
    assert on_gpu.C == fast.C
    assert abs(on_gpu.test_accuracy - fast.test_accuracy) <= 0.005


# --- mlstm-sentiment probe on precomputed feature files -------------------------------------------------


def _write(path: Path, X: np.ndarray, y: np.ndarray, *, label: str = "label") -> str:
    pa_ipc_write(path, features_table(X, **{label: y}))
    return str(path)


def pa_ipc_write(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.fixture(scope="module")
def files(data: Data, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("features")
    return [_write(folder / f"{split}.arrow", *data[split]) for split in ("train", "dev", "test")]


def _probe(*args: str) -> Result:
    from flows.cli import app

    return CliRunner().invoke(app, ["probe", *args])


def test_probe_prints_the_json_summary_and_a_line_per_C(
    files: list[str], fast: ProbeResult, request: pytest.FixtureRequest
) -> None:
    train, dev, test = files
    solver = request.node.callspec.params["fast"]
    result = _probe("--train", train, "--dev", dev, "--test", test, "--solver", solver, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert set(summary) == {
        "test_accuracy",
        "dev_accuracy",
        "C",
        "nonzero",
        "top_unit",
        "top_unit_accuracy",
        "seconds",
    }
    assert summary["test_accuracy"] == fast.test_accuracy and summary["C"] == fast.C
    assert result.stderr.count("dev accuracy") == len(DEFAULT_CS)


def _bad_files(kind: str, data: Data, folder: Path) -> str:
    X, y = data["dev"]
    if kind == "no label":
        return _write(folder / "nolabel.arrow", X, y, label="target")
    if kind == "one class":
        return _write(folder / "oneclass.arrow", X, np.ones_like(y))
    if kind == "nan":
        X = X.copy()
        X[3, 5] = np.nan
        return _write(folder / "nan.arrow", X, y)
    if kind == "scaled":
        return _write(folder / "scaled.arrow", X * 1e30, y)
    if kind == "width 0":
        empty = pa.array([[] for _ in y], type=pa.list_(pa.float32()))
        pa_ipc_write(folder / "empty.arrow", pa.table({"features": empty, "label": y}))
        return str(folder / "empty.arrow")
    if kind == "list labels":
        listed = pa.array([[int(v)] for v in y], type=pa.list_(pa.int64()))
        pa_ipc_write(folder / "listed.arrow", pa.table({"features": pa.array(X.tolist()), "label": listed}))
        return str(folder / "listed.arrow")
    ragged = pa.array([row.tolist()[: 256 - (i % 2)] for i, row in enumerate(X)], type=pa.list_(pa.float32()))
    pa_ipc_write(folder / "ragged.arrow", pa.table({"features": ragged, "label": y}))
    return str(folder / "ragged.arrow")


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("no label", "no column 'label'"),
        ("one class", "column 'label' holds one class only"),
        ("nan", "column 'features' holds 1 NaN or inf values (first in row 3)"),
        ("ragged", "column 'features' has rows of different widths"),
        ("scaled", "column 'features' holds values up to"),
        ("width 0", "column 'features' holds empty vectors"),
        ("list labels", "column 'label' is list<item: int64>: labels are 0 or 1"),
    ],
)
def test_a_bad_feature_file_gets_one_error_naming_file_and_column(
    kind: str, words: str, files: list[str], data: Data, tmp_path: Path
) -> None:
    bad = _bad_files(kind, data, tmp_path)
    result = _probe("--train", files[0], "--dev", bad, "--test", files[2])
    assert result.exit_code == 2
    assert bad in " ".join(result.stderr.split()) and words in " ".join(result.stderr.split())
    assert "Traceback" not in result.output and "dev accuracy" not in result.stderr


# --- real features: a small mLSTM trained here on the shared Amazon corpus, read on SST ----------------


def _amazon_bytes(amazon_dir: Path, limit: int = 600_000) -> np.ndarray:
    """The first ``limit`` bytes of review text of the shared corpus's 2018 files, one review a line."""
    import gzip

    data = bytearray()
    for path in sorted(amazon_dir.glob("*_5.json.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as file:
            for line in file:
                data += (json.loads(line).get("reviewText", "") + "\n").encode()
                if len(data) >= limit:
                    return np.frombuffer(bytes(data[:limit]), dtype=np.uint8)
    return np.frombuffer(bytes(data), dtype=np.uint8)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread: two threads on two shared, busy cores spin and ran 10-80× slower here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def real(shared_data: Path, one_thread: None) -> Data:
    """SST features (2,000 train, all 872 dev, 1,000 test sentences) of a 128-unit mLSTM trained for
    150 steps of 16 × 64 bytes on the shared Amazon reviews (under a minute on two idle cores)."""
    import csv

    from models.features import featurize
    from models.mlstm import MLSTM, MLSTMConfig

    torch.manual_seed(0)
    corpus = torch.from_numpy(_amazon_bytes(shared_data / "amazon").astype(np.int64))
    model = MLSTM(MLSTMConfig(hidden_size=128))
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        starts = torch.randint(0, corpus.numel() - 65, (16,), generator=generator)
        window_BT = torch.stack([corpus[s : s + 65] for s in starts.tolist()])
        logits_BTV, _, _ = model(window_BT[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits_BTV.reshape(-1, 256), window_BT[:, 1:].reshape(-1))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    assert float(loss.detach()) < 3.5, float(loss.detach())  # learned something: uniform bytes cost 5.5 nats

    def split(name: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
        with (shared_data / "sst2" / f"{name}_binary_sent.csv").open(newline="") as file:
            records = list(csv.DictReader(file))[:rows]
        X = featurize(model, [r["sentence"] for r in records], device=torch.device("cpu"))
        return X, np.array([int(r["label"]) for r in records])

    return {"train": split("train", 2000), "dev": split("dev", 872), "test": split("test", 1000)}


def _per_C(data: Data, solver: Solver) -> list[tuple[float, float]]:
    """(dev accuracy, test accuracy) of each C of the default sweep."""
    from tasks.transfer.probe import accuracy, solver_path

    X, y = data["train"]
    path = solver_path(solver, X, y, DEFAULT_CS)
    return [
        (accuracy(p.coef, p.intercept, *data["dev"]), accuracy(p.coef, p.intercept, *data["test"]))
        for p in path
    ]


@pytest.mark.long  # trains a 128-unit mLSTM on the Amazon reviews: about 3 minutes on two cores
def test_on_real_features_newton_matches_liblinear_at_every_C_and_chooses_its_C(
    real: Data, one_thread: None
) -> None:
    theirs, ours = _per_C(real, "liblinear"), _per_C(real, "newton")
    for C, (a, b) in zip(DEFAULT_CS, zip(theirs, ours, strict=True), strict=True):
        assert abs(a[0] - b[0]) <= 0.005 and abs(a[1] - b[1]) <= 0.005, (C, a, b)
    reference, fast = _fit(real, "liblinear"), _fit(real, "newton")
    _assert_objectives_at_most_liblinears(fast, reference)
    dev_of = {p.C: p.dev_accuracy for p in reference.sweep}
    assert fast.C == reference.C or abs(dev_of[fast.C] - reference.dev_accuracy) <= 0.005
    assert abs(fast.test_accuracy - reference.test_accuracy) <= 0.005
    # Above chance on 1,000 sentences: the features carry some sentiment.
    assert reference.test_accuracy > 0.52
