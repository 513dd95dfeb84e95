"""The active-set method's Cholesky factor, updated as its set changes (tasks/transfer/solvers/cholesky.py):
every solve is the fresh one's, on near-singular and on indefinite matrices."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.transfer.solvers import quadratic
from tasks.transfer.solvers.cholesky import FactorOnSet


def _near_low_rank_hessian(k: int, rank: int, seed: int) -> np.ndarray:
    """A Hessian like a near-low-rank working set's: a rank-``rank`` Gram plus a small diagonal."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((k, rank))
    return A @ A.T + np.diag(rng.random(k) * 1e-3)


def _walk(rng: np.random.Generator, k: int, S: np.ndarray) -> np.ndarray:
    """The next set: up to two coordinates leave and up to two join, as active-set steps change it."""
    kept = set(S.tolist())
    for _ in range(int(rng.integers(0, 3))):
        kept.discard(int(rng.choice(sorted(kept))))
    for _ in range(int(rng.integers(0, 3))):
        kept.add(int(rng.integers(k)))
    return np.array(sorted(kept))


@pytest.mark.parametrize("seed", [0, 1])
def test_an_updated_factor_solves_as_a_fresh_one_as_coordinates_join_and_leave(seed: int) -> None:
    k = 300
    H = _near_low_rank_hessian(k, rank=40, seed=seed)
    rng = np.random.default_rng(seed + 10)
    factor, S = FactorOnSet(H), np.sort(rng.choice(k, 120, replace=False))
    solves = 300
    for _ in range(solves):
        rhs = rng.standard_normal(S.size)
        x = factor.solve(S, rhs)
        assert x is not None
        fresh = np.linalg.solve(H[np.ix_(S, S)] + factor.ridge * np.eye(S.size), rhs)
        assert np.abs(x - fresh).max() <= 1e-7 * np.abs(fresh).max()
        S = _walk(rng, k, S)
    # Most solves were updates: a fresh factorisation only at the start and every REFRESH_AFTER updates.
    assert factor.refactorisations < solves // 10


def test_a_coordinate_that_would_make_the_factor_indefinite_grows_the_ridge() -> None:
    """A float32 Hessian can be indefinite past the ridge: a coordinate whose join would give the factor
    a negative pivot makes it factor afresh with a ridge grown until it holds, and solve with that
    ridge, as a fresh damped step does."""
    k = 80
    H = _near_low_rank_hessian(k, rank=20, seed=3)
    bad = np.arange(60, 70)
    H[bad, bad] -= 1e-2  # each of these alone makes a set spanning the rank-20 part indefinite
    rng = np.random.default_rng(4)
    factor, S = FactorOnSet(H), np.sort(rng.choice(60, 40, replace=False))
    factor.solve(S, np.ones(S.size))
    first_ridge = factor.ridge
    for j in bad:
        S = np.union1d(S, [j])
        rhs = rng.standard_normal(S.size)
        x = factor.solve(S, rhs)
        assert x is not None
        matrix = H[np.ix_(S, S)] + factor.ridge * np.eye(S.size)
        assert np.linalg.eigvalsh(matrix).min() > 0
        assert np.abs(matrix @ x - rhs).max() <= 1e-8 * np.abs(matrix).max() * np.abs(x).max()
    assert factor.ridge > 1e3 * first_ridge


def test_the_active_set_method_reaches_its_target_on_a_near_low_rank_model_through_updates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model a near-low-rank working set gives at a large C: solved to its target, the factor
    updated (not refactored) for most of its solves."""
    k = 400
    H = _near_low_rank_hessian(k, rank=16, seed=5)
    rng = np.random.default_rng(6)
    g = rng.standard_normal(k) * 3
    w, lam, target = np.zeros(k), np.full(k, 0.5), 1e-6
    fresh = []
    original = FactorOnSet._factor

    def counted(self: FactorOnSet, S: np.ndarray) -> bool:
        fresh.append(S.size)
        return original(self, S)

    monkeypatch.setattr(FactorOnSet, "_factor", counted)
    d, solves = quadratic.active_set_minimiser(H, g, w, lam, target)
    residual = quadratic.min_subgradient(g + H @ d, w + d, lam)
    assert residual.max() <= target and solves < quadratic.MAX_ACTIVE
    assert len(fresh) < solves / 2, (len(fresh), solves)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_factor_rebased_onto_matrices_that_gain_and_lose_coordinates_solves_as_a_fresh_one(
    dtype: type,
) -> None:
    """The lazy Hessian's case: the matrix holding the form is rebuilt for each working set (float32
    as the sweeps' is), the coordinates it keeps with the same values; the factor, named by the
    coordinates' ids, not their positions, follows the support across the matrices. A factor that
    read the new matrix by the old positions would solve another system."""
    k = 400
    H = _near_low_rank_hessian(k, rank=40, seed=7).astype(dtype)
    rng = np.random.default_rng(8)
    ids = np.sort(rng.choice(k, 200, replace=False))
    support = np.sort(rng.choice(ids, 100, replace=False))
    factor = FactorOnSet(H[np.ix_(ids, ids)], ids)
    solves = 60
    for _ in range(solves):
        S = np.searchsorted(ids, support)  # the support's positions in this matrix
        rhs = rng.standard_normal(S.size)
        x = factor.solve(S, rhs)
        assert x is not None
        fresh = np.linalg.solve(
            H[np.ix_(support, support)].astype(np.float64) + factor.ridge * np.eye(S.size), rhs
        )
        assert np.abs(x - fresh).max() <= 1e-6 * np.abs(fresh).max()
        # The next working set: a few coordinates leave (none of the support's next) and a few join.
        support = _walk(rng, k, support)
        outside = np.setdiff1d(ids, support)
        ids = np.union1d(np.setdiff1d(ids, rng.choice(outside, 3, replace=False)), support)
        ids = np.union1d(ids, rng.choice(k, 3))
        factor.rebase(H[np.ix_(ids, ids)], ids)
    assert factor.refactorisations < solves // 4


def test_a_set_growing_a_coordinate_at_a_time_reallocates_the_factor_a_few_times_within_the_matrix() -> None:
    # Each allocation copies the factor (about 1 % of a near-low-rank sweep when it came on every join):
    # room a quarter past the set, up to the matrix's size, so 10 to 60 coordinates take a handful.
    H = _near_low_rank_hessian(60, rank=20, seed=5)
    factor, memories = FactorOnSet(H), set()
    for n in range(10, 61):
        S = np.arange(n)
        x = factor.solve(S, np.ones(n))
        assert x is not None
        np.testing.assert_allclose(H[np.ix_(S, S)] @ x + factor.ridge * x, 1.0, atol=1e-6)
        memories.add(factor.U.ctypes.data)
        assert n <= factor.U.shape[0] <= 60
    assert len(memories) <= 10
