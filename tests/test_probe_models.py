"""The probe solver's quadratic models (tasks/transfer/solvers/quadratic.py): coordinate sweeps with
Anderson extrapolation, exact steps on the signs and the active-set method, on correlated,
ill-conditioned and indefinite matrices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.transfer.solvers import quadratic
from tasks.transfer.solvers.cholesky import FactorOnSet


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
    assert quadratic.orthant_step(hessian, g, w, lam, u, hd, FactorOnSet(hessian))
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
    assert quadratic.orthant_step(hessian, g, w, lam, fresh_u, fresh_hd, FactorOnSet(hessian))
    assert quadratic.orthant_step(hessian, g, w, lam, u, hd, factor)
    assert factor.refactorisations == 1
    np.testing.assert_allclose(u, fresh_u, rtol=1e-6, atol=1e-9)


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
    assert quadratic.orthant_step(hessian, g, w, lam, u, hd, FactorOnSet(hessian))
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
    step = quadratic._newton_on_signs(S, slope, FactorOnSet(hessian))
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
        step = quadratic._newton_on_signs(np.arange(5), np.ones(5), FactorOnSet(hessian))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert step is not None
    np.testing.assert_allclose(step, -0.5, rtol=1e-6)
    assert seen == [1] and after == 2
