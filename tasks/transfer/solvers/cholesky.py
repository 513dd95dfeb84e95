"""A Cholesky factor of H[S, S] + ridge·I, a principal submatrix of a symmetric matrix H, kept up to
date as the set S gains and loses a few coordinates.

The active-set method (``quadratic.active_set_minimiser``) solves one system per step on sets that
differ from the last by a coordinate or two; the coordinate-descent models' exact steps on the signs
(``quadratic.orthant_step``) solve one on each model's support, which moves little from one model of a
C to the next, while the lazy Hessian holding H gains rows for coordinates new to the working set.
Factoring each afresh costs k³/3 multiply-adds; at the large-C end of a 4,096-wide SST-sized sweep of
near-low-rank features (k ≈ 2,000, hundreds of solves per C) those factorisations were most of the
sweep's time. Here a coordinate joins by one triangular solve (a new row of the factor) and leaves by
a rank-one update of the rows below it (Givens-style, Golub & Van Loan §6.5.4), each about k²
operations; a set that moved too far, or a join that would lose positive definiteness, is factored
afresh by LAPACK with the ridge grown as needed.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

RIDGE = 1e-7  # the ridge, relative to the mean of the factored diagonal: float32 resolution's scale
RIDGE_TRIES = 8  # tenfold ridges tried on a factorisation: up to the mean of its diagonal
REFRESH_AFTER = 64  # updates between fresh factorisations: their rounding accumulates
ROOM_GROWTH = 1.25  # the factor's memory grows to this many times the rows asked for


class FactorOnSet:
    """Solves (H[S, S] + ridge·I) x = r for sets S that change a little from one solve to the next.

    H is one quadratic form over coordinates named by ids; the matrix holding it may change between
    solves (``rebase``) as long as the coordinates both hold keep their values: the proximal Newton
    solver's lazy Hessian gains and loses rows as its working set moves, but its entries for the
    coordinates it keeps are the same numbers, so a factor on them stays valid. The factor's rows are
    kept in the order coordinates joined, not sorted; ``solve`` maps to and from the caller's order. The
    ridge is fixed at each fresh factorisation (``RIDGE`` of that set's mean diagonal, grown tenfold
    while the factorisation fails) and kept by the updates after it.
    """

    def __init__(self, hessian: np.ndarray, ids: np.ndarray | None = None) -> None:
        self.U = np.zeros((0, 0))  # its leading n × n block is the factor, upper: H[S, S] + ridge = UᵀU
        self.order = np.empty(0, dtype=np.intp)  # the id of each of the factor's rows
        self.n = 0
        self.ridge = 0.0
        self.updates = 0
        self.refactorisations = 0  # for tests and benchmarks: how often a set was factored afresh
        self.rebase(hessian, ids)

    def rebase(self, hessian: np.ndarray, ids: np.ndarray | None = None) -> None:
        """The form now held by ``hessian`` (float32 or float64, read, not copied), whose rows and columns
        are the coordinates ``ids`` (ascending; by default 0, 1, …): any coordinate it shares with the
        factor must have the values it had. Coordinates of the factor that it lacks leave at the next
        solve."""
        self.hessian = hessian
        self.ids = np.arange(hessian.shape[0]) if ids is None else np.asarray(ids, dtype=np.intp)

    def solve(self, S: np.ndarray, rhs_S: np.ndarray) -> np.ndarray | None:
        """x with (H[S, S] + ridge·I) x = ``rhs_S`` (``S`` sorted, unique positions in the current
        matrix), or None where no ridge tried makes H[S, S] factorise."""
        S_ids = self.ids[S]
        if not self._move_to(S_ids):
            return None
        order = self.order[: self.n]
        sorter = np.argsort(order)
        rows = sorter[np.searchsorted(order, S_ids, sorter=sorter)]
        x = np.empty(self.n)
        x[rows] = rhs_S
        _solve_in_place(self.U, self.n, x)
        return x[rows]

    def _move_to(self, S_ids: np.ndarray) -> bool:
        current = self.order[: self.n]
        leaving = np.flatnonzero(~np.isin(current, S_ids, assume_unique=True))
        joining = S_ids[~np.isin(S_ids, current, assume_unique=True)]
        changes = leaving.size + joining.size
        # A change costs about n² operations against the factorisation's n³/3 (at BLAS-3 speed, several
        # times the updates' per operation): past a small share of n, factor afresh.
        if not self.n or changes > max(4, self.n // 32) or self.updates + changes > REFRESH_AFTER:
            return self._factor(S_ids)
        for p in leaving[::-1]:  # from the last row up: the rows above keep their positions
            _remove_row(self.U, self.n, int(p))
            self.order[p : self.n - 1] = self.order[p + 1 : self.n].copy()
            self.n -= 1
        self._room(S_ids.size)
        # The matrix's position of each of the factor's rows: what the kernel reads H by.
        at = np.empty(self.U.shape[0], dtype=np.intp)
        at[: self.n] = np.searchsorted(self.ids, self.order[: self.n])
        for j, position in zip(joining, np.searchsorted(self.ids, joining), strict=True):
            if not _append_row(self.U, self.n, self.hessian, at, int(position), self.ridge):
                return self._factor(S_ids)  # it would not stay positive definite: a larger ridge
            self.order[self.n], at[self.n] = j, position
            self.n += 1
        self.updates += changes
        return True

    def _factor(self, S_ids: np.ndarray) -> bool:
        self.refactorisations += 1
        self.n, self.updates = 0, 0
        if not S_ids.size:
            return True
        S = np.searchsorted(self.ids, S_ids)
        factored = ridged_cholesky(np.asarray(self.hessian[np.ix_(S, S)], dtype=np.float64))
        if factored is None:
            return False
        factor, self.ridge = factored
        self._room(S.size)
        self.U[: S.size, : S.size] = factor.numpy().T
        self.order[: S.size] = S_ids
        self.n = S.size
        return True

    def _room(self, n: int) -> None:
        """Room for a factor of n rows, the current one kept: allocated as sets grow, not at the
        matrix's size, so a form whose factor is never asked for costs nothing; a quarter past n, up
        to the matrix's size, so that a set growing by a coordinate at a time does not copy U each
        time (about 1 % of a near-low-rank sweep)."""
        if n <= self.U.shape[0]:
            return
        n = max(n, min(int(n * ROOM_GROWTH), self.ids.size))
        U, order = np.zeros((n, n)), np.empty(n, dtype=np.intp)
        U[: self.n, : self.n] = self.U[: self.n, : self.n]
        order[: self.n] = self.order[: self.n]
        self.U, self.order = U, order


def ridged_cholesky(H_SS: np.ndarray) -> tuple[torch.Tensor, float] | None:
    """The lower Cholesky factor of ``H_SS`` + ridge·I (float64, a matrix of the caller's own, whose
    diagonal it changes) and that ridge: ``RIDGE`` of the mean diagonal, grown tenfold while the
    factorisation fails; None where none of ``RIDGE_TRIES`` ridges makes it factorise.

    Nearly collinear columns leave H_SS numerically singular, and a float32 matrix can be indefinite by
    more than float32's resolution (cell states of a briefly trained 4,096-unit model at C = 4:
    eigenvalues down to -0.04 beside 1.8e7): a larger ridge gives a damped step, which the callers check.
    torch's LAPACK, not scipy's: scipy's OpenBLAS threads spin against torch's OpenMP threads on few
    cores, many times slower (docs/benchmarks.md, Probe).
    """
    ridge = RIDGE * float(np.trace(H_SS)) / H_SS.shape[0] + 1e-300
    diagonal = np.diag_indices_from(H_SS)
    H_SS[diagonal] += ridge
    for _ in range(RIDGE_TRIES):
        factor, info = torch.linalg.cholesky_ex(torch.from_numpy(H_SS))
        if not info:
            return factor, ridge
        H_SS[diagonal] += 9 * ridge
        ridge *= 10
    return None


# The kernels keep the factor as U = Lᵀ, upper triangular and row-major, so that every inner loop (a
# rotation's, a substitution's) runs along a row: contiguous, and vectorised by the compiler.
@numba.njit(cache=True)
def _solve_in_place(U: np.ndarray, n: int, x: np.ndarray) -> None:
    """x ← (Uᵀ U)⁻¹ x for the leading n × n block of U."""
    for i in range(n):  # Uᵀ y = x: a row of U is a column of Uᵀ
        x[i] /= U[i, i]
        xi = x[i]
        for j in range(i + 1, n):
            x[j] -= U[i, j] * xi
    for i in range(n - 1, -1, -1):  # U x = y
        s = x[i]
        for j in range(i + 1, n):
            s -= U[i, j] * x[j]
        x[i] = s / U[i, i]


@numba.njit(cache=True)
def _append_row(U: np.ndarray, n: int, H: np.ndarray, order: np.ndarray, j: int, ridge: float) -> bool:
    """Writes column n of U for H's row j, the factor's rows being H's rows ``order``; False (U
    unchanged) where its pivot would not be positive: j is nearly a combination of the set's columns at
    this ridge."""
    y = np.empty(n)
    for i in range(n):
        y[i] = H[order[i], j]
    s_sq = 0.0
    for i in range(n):  # Uᵀ y = H[order, j]
        y[i] /= U[i, i]
        yi = y[i]
        s_sq += yi * yi
        for m in range(i + 1, n):
            y[m] -= U[i, m] * yi
    pivot = H[j, j] + ridge - s_sq
    if not pivot > 1e-14 * (H[j, j] + ridge):
        return False
    for i in range(n):
        U[i, n] = y[i]
    U[n, n] = np.sqrt(pivot)
    return True


@numba.njit(cache=True)
def _remove_row(U: np.ndarray, n: int, p: int) -> None:
    """Removes row and column p from the n × n factor: the rows below absorb row p's part right of the
    diagonal by a rank-one update (a rotation per row), then move up a row and left a column."""
    x = U[p, p + 1 : n].copy()
    for c in range(p + 1, n):
        a = c - p - 1
        d = U[c, c]
        r = np.sqrt(d * d + x[a] * x[a])
        cos, sin = r / d, x[a] / d
        inv_cos = 1.0 / cos
        U[c, c] = r
        for i in range(c + 1, n):
            b = i - p - 1
            u = (U[c, i] + sin * x[b]) * inv_cos
            x[b] = cos * x[b] - sin * u
            U[c, i] = u
    for r in range(p):
        for c in range(p, n - 1):
            U[r, c] = U[r, c + 1]
    for r in range(p, n - 1):
        for c in range(r, n - 1):
            U[r, c] = U[r + 1, c + 1]
    for c in range(n):
        U[c, n - 1] = 0.0
        U[n - 1, c] = 0.0
