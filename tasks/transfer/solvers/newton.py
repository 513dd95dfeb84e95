"""An L1 logistic-regression path solver: working-set proximal Newton (newGLMNET-style), liblinear's problem.

For each C, ascending, it minimises liblinear's objective divided by C (same minimiser):

    sum_i log(1 + exp(-s_i (w·x_i + b)))  +  (||w||_1 + |b|) / C,        s_i = ±1

(liblinear penalises the intercept as one more feature of value 1). Each C starts from the previous
C's solution, or from the line through the previous two continued in log C where that is lower
(``_extrapolated_start``: at the large-C end the solutions move far from one C to the next). An outer
loop takes the full gradient (one pass over X), stops if the point is optimal, and otherwise picks a
working set W: the non-zero weights plus the worst violators of the optimality conditions, a quarter as
many (at least 100). On W it takes proximal Newton steps (Lee, Sun & Saunders 2014; Yuan, Ho & Lin
2012) with a backtracking (Armijo) line search on the true objective, so every step is a descent:

- The Hessian restricted to W, X_Wᵀ diag(p(1-p)) X_W, is one dense symmetric product (BLAS's syrk on
  CPU threads, half a general product's work, on wide sets; torch's product on narrow ones, where
  switching thread pools costs more than syrk saves, and on the GPU). It is lazy (Doikov, Chayti
  & Jaggi 2023): its weights are those of each C's first Newton step, and later steps reuse it, adding
  only the rows of coordinates new to W; any positive semi-definite matrix still gives a descent
  direction, and building it is most of a sweep's time. It is rebuilt after a poor step (one the line
  search shortened, or one that left more than ``SLOW_STEP`` of W's residual), where p(1-p) has moved.
- The quadratic model plus the L1 term is minimised by ``quadratic.model_minimiser`` (coordinate
  descent with Anderson extrapolation and exact steps on the signs), or, once a model defeats it, by
  ``quadratic.active_set_minimiser`` on a float64 Hessian, for that C and every larger one: near
  separability the matrices' eigenvalues span more than float32 resolves.
- Gradients and scores are float32 sums where their rounding, measured at each C's start, stays below
  ``ROUNDING`` of the tolerance, and float64 sums otherwise (from a float64 copy of the features):
  on features with heavy-tailed scales a float32 gradient entry can be off by more than the tolerance.

Dense linear algebra other than a wide syrk goes through torch (MKL) or compiled loops, not scipy's or numpy's
OpenBLAS, whose threads spin against torch's on few cores. docs/transfer.md (Solvers) says why each
part is there; docs/benchmarks.md (Probe) has the measurements against liblinear.

Convergence: a C is done when the minimum-norm subgradient of the objective above has max-norm
≤ ``tol`` / C over every weight and the intercept (each coordinate's optimality residual is at most
``tol`` of the L1 term's unit slope), or after ``max_outer`` outer iterations. Deterministic: a fixed
coordinate order, no sampling, the same reductions for the same inputs on the same device.
"""

from __future__ import annotations

from collections.abc import Iterator

import numba
import numpy as np
import scipy.linalg.blas
import torch

from tasks.transfer.solvers import PathPoint
from tasks.transfer.solvers.cholesky import FactorOnSet
from tasks.transfer.solvers.quadratic import (
    MAX_SWEEPS,
    active_set_minimiser,
    min_subgradient,
    model_minimiser,
)

TOL = 1e-3
MAX_OUTER = 50
MAX_NEWTON = 20  # Newton steps on one working set before the full gradient is looked at again
MIN_WORKING_SET = 100
INNER = 0.3  # a working set is done when its residual is below this fraction of the full one
MODEL = 0.1  # the quadratic model is solved to this fraction of the residual it started from
SLOW_STEP = 0.5  # a Newton step that leaves more than this of the residual rebuilds the Hessian
ROUNDING = 0.1  # sums in float64 where float32's rounding of the gradient exceeds this share of the tolerance
WHOLE_ABOVE = 0.25  # float64 working sets wider than this share of the features are not gathered
INTERCEPT = np.iinfo(np.intp).max  # the intercept's id among the features' in the exact steps' factor
CONVERT_BYTES = 64 * 2**20  # an exact Hessian's float64 copies of X's rows, at most this much at a time
SYRK_FROM = 512  # Hessians at least this wide are BLAS's syrk on the CPU; narrower ones, torch's product


def l1_logistic_path(
    X_NH: np.ndarray,
    y_N: np.ndarray,
    Cs: tuple[float, ...],
    *,
    device: torch.device | str = "cpu",
    tol: float = TOL,
    max_outer: int = MAX_OUTER,
) -> Iterator[PathPoint]:
    """The L1 logistic probe at each C of ``Cs`` (ascending), warm-started along the path.

    Yields each C's probe as soon as it is solved (for progress), in raw feature units.
    """
    device = torch.device(device)
    # Features as rows of Xᵀ: a working set's columns are then contiguous rows, gathered by one copy.
    # np.array copies: the input may be a read-only memory map, which torch will not wrap.
    XT_HN = torch.from_numpy(np.array(np.asarray(X_NH, dtype=np.float32).T, order="C")).to(device)
    XT64_HN = XT_HN.double()
    s_N = torch.from_numpy(np.asarray(y_N, dtype=np.float64) * 2 - 1).to(device)  # 0/1 → -1/+1
    H = XT_HN.shape[0]
    w_H = np.zeros(H)
    b = 0.0
    z_N = torch.zeros_like(s_N)  # the scores X w + b, carried along the path
    solved: list[tuple[np.ndarray, float, float]] = []  # the last two Cs' weights, intercepts and Cs
    # One along the path: once its models need float64 (``exact``), so do the larger C's after, nearer
    # separability.
    workspace = _Workspace()  # memory reused by the sweep's copies of X's rows
    hessian = _LazyHessian(workspace)
    for C in Cs:
        start = (w_H, b, z_N)
        if len(solved) == 2 and solved[0][2] < solved[1][2] < C:
            start = _extrapolated_start(XT64_HN, s_N, C, start, solved)
        hessian.forget()  # each C's Hessian weighs its rows by that C's first step
        w_H, b, z_N, iterations, converged = _solve(
            XT_HN, XT64_HN, s_N, *start, 1.0 / C, tol, max_outer, hessian, workspace
        )
        solved = [*solved[-1:], (w_H, b, C)]
        yield PathPoint(C=float(C), coef=w_H.copy(), intercept=b, iterations=iterations, converged=converged)


def _extrapolated_start(
    XT_HN: torch.Tensor,
    s_N: torch.Tensor,
    C: float,
    start: tuple[np.ndarray, float, torch.Tensor],
    solved: list[tuple[np.ndarray, float, float]],
) -> tuple[np.ndarray, float, torch.Tensor]:
    """The start for ``C``: the last solution ``start`` (weights, intercept, scores) moved on along the
    line through the two ``solved`` before (weights, intercept, C; the last is ``start``'s), if that
    lowers C's objective; otherwise ``start`` itself.

    The path is smooth in log C between changes of support, so a straight line in log C through the
    solutions at the two C before guesses the next. A weight the line takes through zero stops at
    zero (it is leaving the support), and a zero weight stays zero. On correlated features at the
    large-C end the extrapolated start cut the sweep's coordinate-descent work by a fifth.
    """
    w_H, b, z_N = start
    (w0_H, b0, C0), (_, _, last_C) = solved
    t = np.log(C / last_C) / np.log(last_C / C0)  # 1 on a grid of constant ratio
    guess_H = w_H + t * (w_H - w0_H)
    guess_H = np.where(np.sign(guess_H) == np.sign(w_H), guess_H, 0.0)
    guess_b = b + t * (b - b0)
    guess_N = (torch.from_numpy(guess_H).to(XT_HN) @ XT_HN).double() + guess_b
    lam = 1.0 / C
    if _loss(s_N, guess_N) + lam * (np.abs(guess_H).sum() + abs(guess_b)) < _loss(s_N, z_N) + lam * (
        np.abs(w_H).sum() + abs(b)
    ):
        return guess_H, float(guess_b), guess_N
    return start


def _loss(s_N: torch.Tensor, z_N: torch.Tensor) -> float:
    return float(torch.nn.functional.softplus(-s_N * z_N).sum())


def _solve(
    XT_HN: torch.Tensor,
    XT64_HN: torch.Tensor,
    s_N: torch.Tensor,
    w_H: np.ndarray,
    b: float,
    z_N: torch.Tensor,
    lam: float,
    tol: float,
    max_outer: int,
    hessian: _LazyHessian,
    workspace: _Workspace,
) -> tuple[np.ndarray, float, torch.Tensor, int, bool]:
    newton_steps = 0
    # Gradients and scores are sums over the rows: float32 sums where their rounding, measured here,
    # stays well below this C's tolerance, else float64 ones, from scores recomputed exactly.
    r_N = -s_N * torch.sigmoid(-s_N * z_N)
    rounding = float(((XT_HN @ r_N.to(XT_HN.dtype)).double() - XT64_HN @ r_N).abs().max())
    XG_HN = XT64_HN if rounding > ROUNDING * tol * lam else XT_HN
    if XG_HN is XT64_HN:  # float32 steps along the path leave the scores off by about that much
        z_N = torch.from_numpy(w_H).to(XT64_HN) @ XT64_HN + b
    for _ in range(max_outer):
        r_N = -s_N * torch.sigmoid(-s_N * z_N)  # d loss / d score
        g_H = (XG_HN @ r_N.to(XG_HN.dtype)).double().cpu().numpy()
        g_b = float(r_N.sum())
        residual_H = min_subgradient(g_H, w_H, lam)
        worst = max(float(residual_H.max()), float(min_subgradient(np.array([g_b]), np.array([b]), lam)[0]))
        if worst <= tol * lam:
            return w_H, b, z_N, newton_steps, True
        support = np.flatnonzero(w_H)
        violators = np.flatnonzero((w_H == 0) & (residual_H > 0))
        # A quarter of the support: the Hessian costs k² per row of X, and the outer loop adds more cheaply.
        room = max(MIN_WORKING_SET, support.size // 4)
        if violators.size > room:  # the worst ones; a stable sort keeps ties in index order
            violators = violators[np.argsort(-residual_H[violators], kind="stable")[:room]]
        W = np.sort(np.concatenate([support, violators]))
        rows = torch.from_numpy(W).to(XT_HN.device)
        XT_WN = workspace.rows("working set", XT_HN, rows)
        if XG_HN is XT_HN:
            sums = _Sums(XT_WN)
        elif W.size > WHOLE_ABOVE * XG_HN.shape[0]:
            sums = _Sums(XG_HN, W)
        else:
            sums = _Sums(workspace.rows("working set, float64", XG_HN, rows))
        u_W = np.append(w_H[W], b)  # the intercept is the last coordinate
        target = max(tol * lam, INNER * worst)
        u_W, z_N, steps, stalled = _newton(XT_WN, sums, W, hessian, s_N, z_N, u_W, lam, target)
        newton_steps += steps
        w_H = w_H.copy()
        w_H[W] = u_W[:-1]
        b = float(u_W[-1])
        if stalled:  # the next pass would take the same step from the same point: stop short
            break
    return w_H, b, z_N, newton_steps, False


class _Sums:
    """A working set's sums over the rows of X: its gradient X_Wᵀ r and a step's scores X_W d, from
    ``X_KN``, the working set's rows, or, with ``W`` given, all the rows, of which W's are taken: a large
    float64 working set is not gathered (copying 93 % of IMDB-sized float64 features took as long as
    six products with them)."""

    def __init__(self, X_KN: torch.Tensor, W: np.ndarray | None = None) -> None:
        self.X_KN, self.W = X_KN, W

    def gradient(self, r_N: torch.Tensor) -> np.ndarray:
        g_K = (self.X_KN @ r_N.to(self.X_KN.dtype)).double().cpu().numpy()
        return g_K if self.W is None else g_K[self.W]

    def scores(self, d_W: np.ndarray) -> torch.Tensor:
        if self.W is not None:
            d_K = np.zeros(self.X_KN.shape[0])
            d_K[self.W] = d_W
            d_W = d_K
        return (torch.from_numpy(d_W).to(self.X_KN) @ self.X_KN).double()


def _newton(
    XT_WN: torch.Tensor,
    sums: _Sums,
    W: np.ndarray,
    hessian: _LazyHessian,
    s_N: torch.Tensor,
    z_N: torch.Tensor,
    u_W: np.ndarray,
    lam: float,
    target: float,
) -> tuple[np.ndarray, torch.Tensor, int, bool]:
    """Proximal Newton steps on one working set (its last coordinate the intercept) until its residual
    is ≤ ``target``; the flag: stalled, no step lowers the objective at float precision."""
    k = XT_WN.shape[0]
    lam_W = np.full(k + 1, lam)
    loss = _loss(s_N, z_N)
    last_worst = np.inf
    for step_count in range(MAX_NEWTON):
        p_N = torch.sigmoid(-s_N * z_N)
        r_N = -s_N * p_N
        D_N = p_N * (1 - p_N)
        g_W = np.append(sums.gradient(r_N), float(r_N.sum()))
        worst = float(min_subgradient(g_W, u_W, lam_W).max())
        if worst <= target:
            return u_W, z_N, step_count, False
        if step_count and worst > SLOW_STEP * last_worst:  # a poor step: the model's weights are stale
            hessian.forget()
        last_worst = worst
        matrix, model_target = hessian.on(XT_WN, W, D_N), MODEL * worst
        if not hessian.exact:
            d_W, sweeps = model_minimiser(matrix, g_W, u_W, lam_W, model_target, factor=hessian.factor)
            if sweeps >= MAX_SWEEPS:  # past float32 and coordinate descent: float64 and exact steps
                hessian.go_exact()
                matrix = hessian.on(XT_WN, W, D_N)
        if hessian.exact:
            d_W, _ = active_set_minimiser(matrix, g_W, u_W, lam_W, model_target, factor=hessian.factor)
        dz_N = sums.scores(d_W[:-1]) + float(d_W[-1])
        # Armijo on the true objective; the model's decrease bounds the step's.
        penalty = lam * float(np.abs(u_W).sum())
        decrease = float(g_W @ d_W) + lam * float(np.abs(u_W + d_W).sum()) - penalty
        t = 1.0
        while True:
            trial_loss = _loss(s_N, z_N + t * dz_N)
            if trial_loss + lam * float(np.abs(u_W + t * d_W).sum()) <= loss + penalty + 0.01 * t * decrease:
                break
            if t < 1e-10:  # no descent left at float precision: keep the point
                return u_W, z_N, step_count + 1, True
            t *= 0.5
        if t < 1:  # the model promised more than the objective gave: its weights are stale
            hessian.forget()
        u_W = u_W + t * d_W
        z_N = z_N + t * dz_N
        loss = trial_loss
    return u_W, z_N, MAX_NEWTON, False


class _LazyHessian:
    """X_Wᵀ diag(D) X_W for the working set W, the intercept's row and column last: D is fixed at the
    first call, and a later W reuses the rows it shares with the last one.

    Float32, or float64 from ``go_exact`` on (the next call rebuilds it): cell states of a briefly
    trained 4,096-unit model near separability give matrices whose eigenvalues span 10¹⁰ (4e-4 beside
    1.2e7, hundreds of them below float32's resolution of the largest), and the float32 matrix there
    is indefinite noise in most directions."""

    def __init__(self, workspace: _Workspace | None = None) -> None:
        self.workspace = workspace or _Workspace()  # reused memory for its copies: the sweep's, shared
        self.D_N: torch.Tensor | None = None
        self.W = np.empty(0, dtype=np.intp)
        self.matrix = np.empty((1, 1), dtype=np.float32)
        self.exact = False
        # The exact steps' Cholesky factor on this form (``quadratic.orthant_step``), kept across the
        # models of one C; the intercept is its last coordinate, named ``INTERCEPT``.
        self.factor = FactorOnSet(self.matrix)

    def forget(self) -> None:
        """The next call builds the whole matrix again, with that call's weights (and a new factor)."""
        self.D_N = None

    def go_exact(self) -> None:
        """Float64 from the next call on, which builds the whole matrix again."""
        self.exact = True
        self.forget()

    def on(self, XT_WN: torch.Tensor, W: np.ndarray, D_N: torch.Tensor) -> np.ndarray:
        if self.D_N is not None and np.array_equal(W, self.W):
            return self.matrix
        # Exact: the float32 features' values, the products summed in float64, converted ``CONVERT_BYTES``
        # at a time (a float64 copy of the working set was the sweep's peak memory).
        k = W.size
        whole = self.D_N is None
        if whole:  # the old matrix and the factor on it are freed before the new one is built
            self.D_N = D_N.to(torch.float64 if self.exact else XT_WN.dtype)
            self.matrix = np.empty((1, 1), dtype=np.float32)
            self.factor = FactorOnSet(self.matrix)
        weights = self.D_N
        assert weights is not None  # set above, or by the call that built the matrix grown here
        matrix = np.empty((k + 1, k + 1), dtype=np.float64 if self.exact else np.float32)
        matrix[k, k] = float(weights.double().sum())
        ids = np.append(W, INTERCEPT)
        if whole:
            gram = matrix[:k, :k]
            matrix[:k, k] = matrix[k, :k] = _weighted_gram(XT_WN, weights, gram, self.workspace)
            self.factor = FactorOnSet(matrix, ids)
        else:  # the entries of the coordinates kept are the same numbers: the factor on them holds
            self._grow(XT_WN, W, weights, matrix)
            self.factor.rebase(matrix, ids)
        self.W, self.matrix = W, matrix
        return matrix

    def _grow(self, XT_WN: torch.Tensor, W: np.ndarray, D_N: torch.Tensor, matrix: np.ndarray) -> None:
        """Fills ``matrix`` for the working set ``W`` from the last one's: the rows both share copied,
        the new rows and the intercept's column computed with the same weights ``D_N``."""
        k = W.size
        shared = np.isin(W, self.W, assume_unique=True)
        old, new = np.flatnonzero(shared), np.flatnonzero(~shared)
        _gather(self.matrix, np.searchsorted(self.W, W[shared]), old, matrix)
        column = torch.zeros(k, dtype=D_N.dtype, device=XT_WN.device)
        rows = torch.zeros((new.size, k), dtype=D_N.dtype, device=XT_WN.device)
        new_rows = torch.from_numpy(new).to(XT_WN.device)
        for n, X_KN in _in_dtype(XT_WN, D_N.dtype):
            column += X_KN @ D_N[n]
            if new.size:
                rows += self.workspace.rows("new rows", X_KN, new_rows).mul_(D_N[n]) @ X_KN.T
        matrix[:k, k] = matrix[k, :k] = column.cpu().numpy()
        matrix[new, :k] = rows.cpu().numpy()
        matrix[:k, new] = matrix[new, :k].T


class _Workspace:
    """A sweep's reused CPU memory for the copies every outer iteration makes: a working set's rows of
    X, their scaled copy for the Hessian, the rows new to the lazy Hessian. A fresh large tensor is
    fresh pages, mapped 4 KB at a time as they are first touched: gathering 1,800 rows of SST-sized
    features into a new tensor took 22 ms, into one already touched 3 (docs/transfer.md, Solvers).
    Each buffer grows to a quarter past the largest size asked of it, so the sweep's growing working
    sets reallocate it a few times, not every iteration. Off the CPU the caching allocator does this."""

    GROWTH = 1.25

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def empty(
        self, name: str, shape: tuple[int, ...], like: torch.Tensor, most: int | None = None
    ) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` in ``like``'s dtype and device, from the buffer ``name``:
        valid until the next call with that name. ``most``: the largest size that name will ask for,
        which its growth does not pass."""
        if like.device.type != "cpu":
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        size = int(np.prod(shape))
        key = (name, like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            self._buffers.pop(key, None)  # the old one's memory is free before the new is allocated
            grown = int(size * self.GROWTH) if most is None else max(size, min(int(size * self.GROWTH), most))
            buffer = self._buffers[key] = torch.empty(grown, dtype=like.dtype)
        return buffer[:size].view(shape)

    def rows(self, name: str, XT_KN: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``XT_KN[rows]`` into the buffer ``name``, which never grows past all of ``XT_KN``'s rows."""
        out = self.empty(name, (rows.numel(), *XT_KN.shape[1:]), XT_KN, most=XT_KN.numel())
        return torch.index_select(XT_KN, 0, rows, out=out)


def _in_dtype(XT_KN: torch.Tensor, dtype: torch.dtype) -> Iterator[tuple[slice, torch.Tensor]]:
    """``XT_KN``'s rows of X (its columns) in ``dtype``, with their slice: the tensor itself where it is
    in that dtype already, else converted in parts of at most ``CONVERT_BYTES``, each a copy of its own.

    Parts sized by bytes, not rows: a narrow working set's whole copy is small, and each part is a
    round of small calls (on ~100-wide sets of 6,906 rows, seven 1,024-row parts took 67 ms a Hessian,
    one 11: the switches between syrk's threads and torch's, below)."""
    K, N = XT_KN.shape
    if XT_KN.dtype == dtype:
        yield slice(0, N), XT_KN
        return
    rows = max(1, CONVERT_BYTES // (max(K, 1) * dtype.itemsize))
    for n0 in range(0, N, rows):
        n = slice(n0, min(n0 + rows, N))
        yield n, XT_KN[:, n].to(dtype)


def _weighted_gram(
    XT_KN: torch.Tensor, D_N: torch.Tensor, out: np.ndarray, workspace: _Workspace
) -> np.ndarray:
    """X_Kᵀ diag(D) X_K [K, K] written into ``out``, and X_Kᵀ D [K] returned, summed in D's dtype and
    accumulated over ``_in_dtype``'s parts, the scaled rows in ``workspace``.

    Wide sets on the CPU take syrk (one triangle, half a product's work); narrower ones, and any set
    off the CPU, torch's product. syrk is scipy's OpenBLAS, whose threads spin after each call and
    slow torch's next calls on two cores: a switch cost milliseconds, more than syrk saved on a
    narrow set (at 100 × 6,906 float64, 11 ms a Hessian against 2.6 through torch; at 2,000 wide,
    syrk 412 ms against 637)."""
    K = XT_KN.shape[0]
    dtype = D_N.dtype
    float64 = dtype == torch.float64
    column = torch.zeros(K, dtype=dtype, device=XT_KN.device)
    blas = XT_KN.device.type == "cpu" and K >= SYRK_FROM
    if blas:
        # Fortran order: syrk accumulates into it in place; its column-major upper triangle is, read
        # row-major (its transpose), the lower one.
        upper = np.zeros((K, K), dtype=np.float64 if float64 else np.float32, order="F")
        syrk = scipy.linalg.blas.dsyrk if float64 else scipy.linalg.blas.ssyrk
    else:
        product = torch.zeros((K, K), dtype=dtype, device=XT_KN.device)
    for n, X_KN in _in_dtype(XT_KN, dtype):
        column += X_KN @ D_N[n]
        root = D_N[n].sqrt()
        if X_KN is not XT_KN:  # a converted part is its own
            scaled = X_KN.mul_(root)
        else:
            scaled = torch.mul(X_KN, root, out=workspace.empty("scaled", X_KN.shape, X_KN))
        if 0 in scaled.shape:  # BLAS refuses an empty matrix with a message on stdout, which --json owns
            continue
        if blas:
            # Aᵀ of a row-major [K, N] array is column-major [N, K]: what syrk reads without a copy.
            syrk(1.0, scaled.numpy().T, beta=1.0, c=upper, trans=1, overwrite_c=1)
        else:
            product.addmm_(scaled, scaled.T)
    # The product's lower triangle too, so that the matrix is symmetric to the bit either way.
    _mirror(upper.T if blas else product.cpu().numpy(), out)
    return column.cpu().numpy()


# Compiled: numpy's fancy indexing (``out[np.ix_(old, old)] = src.take(at, 0).take(at, 1)``) took 14 ms
# at k ≈ 2,000, this 2.5, on every working set that grows.
@numba.njit(cache=True)
def _gather(src: np.ndarray, at: np.ndarray, old: np.ndarray, out: np.ndarray) -> None:
    """out[old[a], old[b]] = src[at[a], at[b]] for every a, b: the entries a grown matrix keeps."""
    for a in range(old.size):
        row, i = src[at[a]], old[a]
        for b in range(old.size):
            out[i, old[b]] = row[at[b]]


# Compiled and blocked: numpy's triu, transpose and add took a fifth of the Gram matrix's time at k ≈ 2,000.
@numba.njit(cache=True)
def _mirror(lower: np.ndarray, out: np.ndarray) -> None:
    """out = the symmetric matrix whose lower triangle (diagonal included) is ``lower``'s."""
    k, block = lower.shape[0], 64
    for i0 in range(0, k, block):
        for j0 in range(0, i0 + block, block):
            for i in range(i0, min(i0 + block, k)):
                for j in range(j0, min(j0 + block, i + 1)):
                    out[i, j] = out[j, i] = lower[i, j]
