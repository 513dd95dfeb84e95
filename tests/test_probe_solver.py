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
from tasks.transfer.solvers.cholesky import FactorOnSet

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


@pytest.mark.parametrize("exact", [False, True])
def test_the_lazy_hessian_keeps_its_first_weights_and_reuses_shared_rows(
    exact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Against X_Wᵀ diag(D) X_W in float64, D the first call's weights, for a working set that grows
    # and one that drops coordinates; the intercept is the last row and column. Exact: float64 sums of
    # the float32 features, converted in parts of 64 rows of X on the 3-wide sets (38 on the 5-wide).
    monkeypatch.setattr(newton, "CONVERT_BYTES", 64 * 3 * 8)
    rng = np.random.default_rng(0)
    XT_HN = torch.from_numpy(rng.standard_normal((40, 300)).astype(np.float32))
    first_D, later_D = (torch.from_numpy(rng.uniform(0.05, 0.25, 300)) for _ in range(2))
    hessian = newton._LazyHessian()
    if exact:
        hessian.go_exact()
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if exact else {"rtol": 1e-5, "atol": 1e-4}

    def expected(W: np.ndarray) -> np.ndarray:
        X = np.vstack([XT_HN.numpy()[W].astype(np.float64), np.ones(300)])
        return (X * first_D.numpy()) @ X.T

    for W, D in (
        (np.array([1, 4, 9]), first_D),
        (np.array([1, 2, 4, 9, 30]), later_D),
        (np.array([2, 9, 31]), later_D),
    ):
        got = hessian.on(XT_HN[torch.from_numpy(W)], W, D)
        assert got.dtype == (np.float64 if exact else np.float32)
        np.testing.assert_allclose(got, expected(W), **tolerance)


def test_the_lazy_hessian_carries_one_cholesky_factor_through_a_C_and_a_new_one_after_forgetting() -> None:
    # The exact steps' factor is named by feature ids: a working set that gains and drops coordinates
    # keeps it (rebased onto the new matrix, its shared entries the same numbers), and solves through it
    # are those of the new matrix; new weights (forget) make a new one.
    rng = np.random.default_rng(1)
    XT_HN = torch.from_numpy(rng.standard_normal((40, 300)).astype(np.float32))
    D = torch.from_numpy(rng.uniform(0.05, 0.25, 300))
    hessian = newton._LazyHessian()
    first = hessian.on(XT_HN[torch.arange(0, 30)], np.arange(0, 30), D)
    factor = hessian.factor
    S = np.array([3, 7, 12, 29, 30])  # the last: the intercept
    factor.solve(S, np.ones(S.size))
    W = np.arange(5, 35)
    matrix = hessian.on(XT_HN[torch.from_numpy(W)], W, D)
    assert hessian.factor is factor
    S = np.searchsorted(W, [7, 12, 29, 33])
    S = np.append(S, W.size)  # the intercept, still last
    x = factor.solve(S, np.ones(S.size))
    assert x is not None and factor.refactorisations == 1
    fresh = np.linalg.solve(
        matrix[np.ix_(S, S)].astype(np.float64) + factor.ridge * np.eye(S.size), np.ones(S.size)
    )
    np.testing.assert_allclose(x, fresh, rtol=1e-6)
    assert first[7, 12] == matrix[2, 7]  # the shared entries are the same numbers
    hessian.forget()
    hessian.on(XT_HN[torch.from_numpy(W)], W, D)
    assert hessian.factor is not factor


def test_the_workspace_gathers_rows_into_memory_it_reuses() -> None:
    # The same rows as indexing does, written into one buffer while the sets fit in it (fresh memory's
    # first touch was most of each gather's time); a larger set grows it, never past all the rows.
    rng = np.random.default_rng(2)
    XT = torch.from_numpy(rng.standard_normal((50, 70)).astype(np.float32))
    workspace = newton._Workspace()
    first = workspace.rows("working set", XT, torch.arange(0, 45))
    torch.testing.assert_close(first, XT[:45])
    assert first.untyped_storage().nbytes() == XT.untyped_storage().nbytes()  # 56 rows' room, capped at 50
    rows = torch.tensor([1, 5, 9, 33])
    again = workspace.rows("working set", XT, rows)
    torch.testing.assert_close(again, XT[rows])
    assert again.data_ptr() == first.data_ptr()
    grown = workspace.rows("working set", XT, torch.arange(0, 50))
    torch.testing.assert_close(grown, XT)
    other = workspace.rows("new rows", XT, rows)
    assert other.data_ptr() != grown.data_ptr()


def _correlated_model(
    k: int = 300, seed: int = 0, *, noise: float = 0.3, penalty: float = 0.01, rows: int = 2000
) -> tuple[np.ndarray, ...]:
    """A quadratic model as a Newton step meets it on cell states: the Hessian of k tanh columns sharing
    32 factors with little noise of their own, log-normal scales (σ = 1); the gradient of random
    residuals, a zero start, and L1 weights of ``penalty`` times the largest gradient entry (by default,
    about 90 of 300 coordinates non-zero)."""
    rng = np.random.default_rng(seed)
    X = np.tanh(
        rng.standard_normal((rows, 32)) @ rng.standard_normal((32, k)) / 4
        + noise * rng.standard_normal((rows, k))
    )
    X *= rng.lognormal(0.0, 1.0, k)
    g = X.T @ (0.5 * rng.standard_normal(rows))
    return (X.T @ X / 4).astype(np.float32), g, np.zeros(k), np.full(k, penalty * np.abs(g).max())


def test_anderson_extrapolation_cuts_the_sweeps_to_the_same_minimiser() -> None:
    hessian, g, w, lam = _correlated_model()
    target = 1e-4 * np.abs(g).max()
    # Sweeps alone, with and without the extrapolation (no exact steps, which would hide it).
    plain, plain_sweeps = quadratic.model_minimiser(hessian, g, w, lam, target, anderson=0, exact_every=0)
    fast, fast_sweeps = quadratic.model_minimiser(hessian, g, w, lam, target, exact_every=0)
    assert plain_sweeps < quadratic.MAX_SWEEPS  # both solved it, one faster
    assert fast_sweeps * 1.5 <= plain_sweeps, (fast_sweeps, plain_sweeps)
    np.testing.assert_allclose(fast, plain, atol=1e-3 * np.abs(plain).max())


def test_exact_steps_on_the_signs_solve_a_nearly_collinear_model_in_fewer_sweeps() -> None:
    # 29 units that are nearly constant (0.3 plus noise of 1 % times log-normal scales) beside the
    # intercept: cell states of a briefly trained model, on which plain sweeps crawl.
    rng = np.random.default_rng(0)
    X = np.hstack(
        [0.3 + 0.01 * rng.standard_normal((2000, 29)) * rng.lognormal(0, 1, 29), np.ones((2000, 1))]
    )
    hessian = (X.T @ X / 4).astype(np.float32)
    g = X.T @ (0.5 * rng.standard_normal(2000) + 0.05)
    w, lam = np.zeros(30), np.full(30, 0.02 * np.abs(g).max())
    target = 1e-3 * np.abs(g).max()
    _, plain_sweeps = quadratic.model_minimiser(hessian, g, w, lam, target, exact_every=0)
    d, sweeps = quadratic.model_minimiser(hessian, g, w, lam, target)
    assert sweeps * 2 <= plain_sweeps, (sweeps, plain_sweeps)
    residual = quadratic.min_subgradient(g + hessian.astype(np.float64) @ d, w + d, lam)
    assert residual.max() <= target


def test_a_large_correlated_model_is_solved_by_exact_steps_where_sweeps_alone_stop_at_their_cap() -> None:
    # 600 coordinates (past the small models' schedule) of columns sharing 32 factors with little noise
    # of their own: the large-C end of a 4,096-wide IMDB-sized sweep, where every model stopped at the cap.
    hessian, g, w, lam = _correlated_model(600, noise=0.05, penalty=0.001, rows=3000)
    target = 1e-3 * np.abs(g).max()

    def solved(d: np.ndarray) -> bool:
        return bool(quadratic.min_subgradient(g + hessian.astype(np.float64) @ d, w + d, lam).max() <= target)

    plain, plain_sweeps = quadratic.model_minimiser(hessian, g, w, lam, target, exact_every=0)
    d, sweeps = quadratic.model_minimiser(hessian, g, w, lam, target)
    assert plain_sweeps == quadratic.MAX_SWEEPS and not solved(plain)
    assert sweeps <= quadratic.MAX_SWEEPS // 2 and solved(d), sweeps


def test_an_ill_conditioned_model_is_solved_by_the_active_set_method_where_sweeps_stop_at_their_cap() -> None:
    # 300 columns of 8 shared factors with noise of 0.1 % and log-normal scales (σ = 2): a float64
    # matrix of condition about 1e15, as a Newton step on cell states of a briefly trained 4,096-unit
    # model meets at the large-C end, where every model stopped at the sweeps' cap.
    rng = np.random.default_rng(0)
    X = np.tanh(
        rng.standard_normal((2000, 8)) @ rng.standard_normal((8, 300)) / 4
        + 1e-3 * rng.standard_normal((2000, 300))
    )
    X *= rng.lognormal(0.0, 2.0, 300)
    hessian = X.T @ X / 4
    g = X.T @ (0.5 * rng.standard_normal(2000))
    w, lam = np.zeros(300), np.full(300, 1e-4 * np.abs(g).max())
    target = 1e-3 * np.abs(g).max()

    def residual(d: np.ndarray) -> float:
        return float(quadratic.min_subgradient(g + hessian @ d, w + d, lam).max())

    swept, sweeps = quadratic.model_minimiser(hessian, g, w, lam, target)
    assert sweeps == quadratic.MAX_SWEEPS and residual(swept) > 10 * target
    d, solves = quadratic.active_set_minimiser(hessian, g, w, lam, target)
    assert solves < quadratic.MAX_ACTIVE and residual(d) <= target, (solves, residual(d) / target)
    assert quadratic.model_value(w + d, hessian @ d, g, w, lam) < 0.0  # below the start's: a descent


def test_a_coordinate_the_active_set_step_moves_against_its_sign_stays_out() -> None:
    # Two nearly equal columns, both violating optimality at zero with the same sign. Brought in
    # together, the solve on those signs sends the second far negative: taken, that step raises the
    # model, and with no other point on its segment the method would stop at the start. Left out, the
    # first alone is a descent, and the model is solved.
    hessian = np.array([[1.0, 0.999], [0.999, 1.0]])
    g, w, lam = np.array([-1.0, -0.9]), np.zeros(2), np.full(2, 0.1)
    target = 1e-9
    d, solves = quadratic.active_set_minimiser(hessian, g, w, lam, target)
    assert quadratic.min_subgradient(g + hessian @ d, w + d, lam).max() <= target, (d, solves)
    np.testing.assert_allclose(d, [0.9, 0.0], atol=1e-9)  # the minimiser: the second at zero


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


def test_an_exact_step_whose_signs_would_flip_keeps_the_projected_whole_step_where_it_is_lower() -> None:
    # A separable model (hessian 2·I): its minimiser on the non-negative orthant is the unconstrained
    # one with the negative coordinates set to zero. The whole step, projected, lands there at once;
    # the step cut at the first coordinate to reach zero would stop short on every other one.
    rng = np.random.default_rng(0)
    hessian = 2 * np.eye(12, dtype=np.float32)
    g, w, lam = 3 * rng.standard_normal(12), np.zeros(12), np.full(12, 0.5)
    u = np.abs(rng.standard_normal(12)) + 0.1  # every coordinate positive: the signs held
    hd = hessian.astype(np.float64) @ (u - w)
    unconstrained = -np.sign(g) * np.maximum(np.abs(g) - lam, 0.0) / 2
    assert (unconstrained < 0).sum() >= 3  # several would flip
    assert quadratic.orthant_step(hessian, g, w, lam, u, hd)
    np.testing.assert_allclose(u, np.maximum(unconstrained, 0.0), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(hd, hessian.astype(np.float64) @ (u - w), rtol=1e-9)


def test_an_exact_step_through_a_carried_factor_moves_as_a_fresh_one() -> None:
    # The same model's exact step, once factored afresh and once through a factor carried over from a
    # support two coordinates away (updated, not refactored): the same point, to rounding.
    hessian, g, w, lam = _correlated_model(k=120)
    rng = np.random.default_rng(3)
    u = np.where(rng.random(120) < 0.5, 0.0, -np.sign(g) * 0.01)
    hd = hessian.astype(np.float64) @ (u - w)
    factor = FactorOnSet(hessian)
    S = np.flatnonzero(u)
    factor.solve(np.sort(np.append(S[2:], np.flatnonzero(u == 0)[:2])), np.ones(S.size))
    fresh_u, fresh_hd = u.copy(), hd.copy()
    assert quadratic.orthant_step(hessian, g, w, lam, fresh_u, fresh_hd)
    assert quadratic.orthant_step(hessian, g, w, lam, u, hd, factor)
    assert factor.refactorisations == 1
    np.testing.assert_allclose(u, fresh_u, rtol=1e-6, atol=1e-9)


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


@pytest.mark.parametrize(
    "stale",
    [
        0.01,  # far too little curvature: the steps overshoot and the line search halves one
        10.0,  # far too much: the steps are short, each leaving most of the residual
    ],
)
def test_a_poor_newton_step_rebuilds_the_hessian_with_current_weights(stale: float) -> None:
    # A Hessian whose weights are those of a far-away point: the next step's Hessian must take the
    # current weights instead of keeping the stale ones for the rest of the C.
    rng = np.random.default_rng(0)
    X = rng.standard_normal((500, 20)).astype(np.float32)
    s_N = torch.from_numpy(np.where(rng.random(500) < 0.5, -1.0, 1.0))
    XT = torch.from_numpy(np.ascontiguousarray(X.T))
    W = np.arange(20)
    weights: list[torch.Tensor] = []  # those of each matrix the steps used

    class Watched(newton._LazyHessian):
        def on(self, XT_WN: torch.Tensor, W: np.ndarray, D_N: torch.Tensor) -> np.ndarray:
            matrix = super().on(XT_WN, W, D_N)
            weights.append(self.D_N.clone())  # type: ignore[union-attr]
            return matrix

    hessian = Watched()
    hessian.on(XT, W, torch.full((500,), stale, dtype=torch.float64))
    newton._newton(
        XT, newton._Sums(XT), W, hessian, s_N, torch.zeros(500, dtype=torch.float64), np.zeros(21), 1.0, 1e-6
    )
    assert any(not torch.allclose(D, torch.tensor(stale, dtype=D.dtype)) for D in weights[1:]), (
        "stale weights stayed"
    )


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


@pytest.mark.parametrize("syrk", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 200])
def test_the_weighted_gram_is_the_whole_symmetric_product_also_into_a_view(
    rows: int, dtype: torch.dtype, syrk: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # syrk fills one triangle, torch's product both, accumulated over the parts that float32 features
    # are converted to float64 in (five here); the compiled mirror, blocked by 64, must fill the other
    # triangle from the lower one at every size, also into the corner of a larger matrix (the lazy
    # Hessian's, whose last row is the intercept's), so that either way the matrix is symmetric.
    monkeypatch.setattr(newton, "CONVERT_BYTES", 64 * rows * 8)
    monkeypatch.setattr(newton, "SYRK_FROM", 0 if syrk else rows + 1)
    rng = np.random.default_rng(rows)
    A = torch.from_numpy(rng.standard_normal((rows, 300)).astype(np.float32))
    D = torch.from_numpy(rng.uniform(0.05, 0.25, 300)).to(dtype)
    X, D64 = A.double().numpy(), D.double().numpy()
    exact = dtype == torch.float64
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if exact else {"rtol": 1e-5, "atol": 1e-4}
    matrix = np.full((rows + 1, rows + 1), -1.0, dtype=np.float64 if exact else np.float32)
    column = newton._weighted_gram(A, D, matrix[:rows, :rows], newton._Workspace())
    np.testing.assert_allclose(matrix[:rows, :rows], (X * D64) @ X.T, **tolerance)
    np.testing.assert_allclose(column, X @ D64, **tolerance)
    assert (matrix[rows] == -1).all() and (matrix[:, rows] == -1).all()
    assert (matrix[:rows, :rows] == matrix[:rows, :rows].T).all()


@pytest.mark.parametrize("wide", [1, 3, 7])
def test_features_are_converted_in_parts_of_at_most_the_byte_budget_in_order(
    wide: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An exact Hessian's float64 copies of X are bounded by bytes, whatever the working set's width:
    # the parts cover every row of X once, in order, each within the budget (40 float64 numbers).
    monkeypatch.setattr(newton, "CONVERT_BYTES", 40 * 8)
    XT_KN = torch.from_numpy(np.random.default_rng(wide).standard_normal((wide, 300)).astype(np.float32))
    parts = list(newton._in_dtype(XT_KN, torch.float64))
    assert all(part.dtype == torch.float64 and part.numel() <= 40 for _, part in parts)
    assert [n.start for n, _ in parts] == [0, *(n.stop for n, _ in parts[:-1])] and parts[-1][0].stop == 300
    np.testing.assert_array_equal(torch.cat([part for _, part in parts], 1).numpy(), XT_KN.double().numpy())


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_the_gram_of_an_empty_matrix_is_zeros_and_prints_nothing(
    shape: tuple[int, int], capfd: pytest.CaptureFixture[str]
) -> None:
    """An empty working set (no row, or no column yet): BLAS's syrk would print its refusal on stdout,
    where `pipeline --json` writes the result."""
    gram = np.full((shape[0], shape[0]), -1.0, dtype=np.float32)
    column = newton._weighted_gram(torch.zeros(shape), torch.zeros(shape[1]), gram, newton._Workspace())
    assert not gram.any() and not column.any()
    assert capfd.readouterr().out == ""


def test_an_exact_step_on_a_float32_matrix_indefinite_past_its_ridge_is_damped_not_dropped() -> None:
    # One direction 1e7 and the rest 100 to 0.01, as on real 4,096-wide cell states at C = 4, where the
    # float32 matrix had an eigenvalue at -0.04: here one at about -0.5, ten times the first ridge (a
    # 1e-7 share of the mean diagonal), so that ridge does not make it factorise; without a larger one
    # the step was skipped every time.
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    eigenvalues = np.concatenate([[1e7], np.logspace(2, -2, 38), [-0.5]])
    hessian = ((Q * eigenvalues) @ Q.T).astype(np.float32)
    hessian = (hessian + hessian.T) / 2
    first_ridge = 1e-7 * float(np.trace(hessian.astype(np.float64))) / 40
    assert np.linalg.eigvalsh(hessian.astype(np.float64))[0] < -10 * first_ridge
    g, w, lam = 1e3 * rng.standard_normal(40), np.zeros(40), np.full(40, 1.0)
    u = np.sign(-g) * 1e-3  # every coordinate non-zero, with the signs the step keeps
    hd = hessian.astype(np.float64) @ (u - w)
    before = quadratic.model_value(u, hd, g, w, lam)
    assert quadratic.orthant_step(hessian, g, w, lam, u, hd)
    assert quadratic.model_value(u, hd, g, w, lam) < before
    np.testing.assert_allclose(hd, hessian.astype(np.float64) @ (u - w), rtol=1e-9, atol=1e-6)


def test_an_exact_step_on_near_low_rank_features_solves_its_system_to_rounding() -> None:
    # A near-low-rank Gram matrix (rank-16 latent through tanh, noise 0.05, log-normal scales), as the
    # large-C end of a near-low-rank sweep gives, on a subset of its coordinates: the step solves
    # (H_SS + ridge) step = -slope, whose ridge is the smallest tried. A factor applied wrongly (read
    # as its transpose) solves another system.
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((2000, 16))
    X = np.tanh(latent @ rng.standard_normal((16, 300)) / 4) + 0.05 * rng.standard_normal((2000, 300))
    X *= rng.lognormal(0.0, 1.0, 300)
    hessian = (X.T @ X / 8).astype(np.float32)
    S = np.sort(rng.choice(300, 200, replace=False))
    slope = rng.standard_normal(S.size)
    step = quadratic._newton_on_signs(hessian, S, slope)
    assert step is not None
    H_SS = hessian[np.ix_(S, S)].astype(np.float64)
    H_SS += 1e-7 * np.trace(H_SS) / S.size * np.eye(S.size)
    # The residual, not the distance to another solver's step: the matrix spans about 10⁸.
    residual = np.abs(H_SS @ step + slope).max()
    assert residual <= 1e-8 * np.abs(H_SS).max() * np.abs(step).max()


def test_an_exact_step_runs_torch_on_one_thread_and_gives_the_callers_threads_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the shared 2-core machine two threads made each exact step 3 to 12 times slower; the caller's
    # own products (the Hessian, the gradients) keep their threads.
    seen: list[int] = []
    factorise = torch.linalg.cholesky_ex

    def watched(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(torch.get_num_threads())
        return factorise(A)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", watched)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        hessian = np.eye(5, dtype=np.float32) * 2
        step = quadratic._newton_on_signs(hessian, np.arange(5), np.ones(5))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert step is not None
    np.testing.assert_allclose(step, -0.5, rtol=1e-6)
    assert seen == [1] and after == 2
