"""The probe solver's Hessians (tasks/transfer/solvers/newton.py): the lazy Hessian's weights, shared
rows and carried factor, the weighted Gram matrix through syrk and torch's product, the float64
conversions' parts and the sweep's reused memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.transfer.solvers import newton


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
