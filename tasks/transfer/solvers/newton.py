"""An L1 logistic-regression path solver: working-set proximal Newton (newGLMNET-style), liblinear's problem.

For each C, ascending, it minimises liblinear's objective divided by C (same minimiser):

    sum_i log(1 + exp(-s_i (w·x_i + b)))  +  (||w||_1 + |b|) / C,        s_i = ±1

(liblinear penalises the intercept as one more feature of value 1). Each C starts from the previous
C's solution, or from the line through the previous two continued to this C where that is lower
(``_extrapolated_start``). An outer loop takes the full gradient (one pass over X), stops if the point is optimal,
and otherwise picks a working set W: the non-zero weights plus the worst violators of the optimality
conditions, a quarter as many (at least 100). On W it takes proximal Newton steps (Lee, Sun & Saunders
2014; Yuan, Ho & Lin 2012): the Hessian restricted to W, X_Wᵀ diag(p(1-p)) X_W, is one dense
symmetric product (BLAS's syrk on CPU threads, half a general product's work; a matrix product on the
GPU); the quadratic model plus the L1 term is minimised by cyclic coordinate descent on that k × k
matrix, compiled with numba (one matrix row per changed coordinate); a backtracking (Armijo) line
search on the true objective keeps every step a descent. Working sets stay small at the small-C end,
so a C costs a few passes over X.

The Hessian is lazy (Doikov, Chayti & Jaggi 2023): its weights p(1-p) are those of each C's first
Newton step, and later steps at that C reuse the matrix, computing only the rows of coordinates new to
the working set. Building the k × k matrix was about two thirds of a 4096-wide sweep's CPU time;
within one C the weights move little, and any positive semi-definite matrix still gives a descent
direction for the line search, so the extra (cheap) steps cost less than the builds they save: the
sweep took half the time (docs/benchmarks.md). The converged point is the same: only the gradient,
always exact, decides when a C is done.

Six things keep it fast on features conditioned like real cell states (columns sharing a few
factors with little noise of their own, unit scales spread over orders of magnitude; issue 27), on
which the sweeps above and the lazy Hessian had made it no faster than liblinear:

- The lazy Hessian is rebuilt, with the current weights, after a poor step: one the line search had to
  shorten (the model's curvature too low) or one that left more than half of the working set's residual
  (too high). Near separability, at the large-C end, p(1-p) moves far within one C; the stale matrix
  had made each C's Newton steps converge linearly, 30 to 50 of them.
- The coordinate sweeps on the quadratic model are Anderson-accelerated (Bertrand & Massias 2021,
  as skglm does): on correlated columns plain sweeps creep along the model's flat valley and often
  stopped at their cap of 200; every 5 sweeps an extrapolation of the last iterates is taken where it
  lowers the model.
- The models also take exact steps on their signs every 10 or 20 sweeps (``_orthant_step``): on cell
  states of a briefly trained model, whose nearly constant units are collinear with the intercept,
  the sweeps made no headway even on 30 coordinates and the large-C end never converged; on the
  large working sets of a 4,096-wide IMDB-sized sweep they stopped at their cap, every time. Where the
  float32 matrix is indefinite past its ridge (real 4,096-wide cell states at C = 4), the ridge grows
  until it factorises: without that, that C ran to its outer cap.
- Gradients and scores are float64 sums where float32's would round too coarsely for the tolerance.
  On IMDB-sized features with heavy-tailed scales, a float32 gradient entry (a sum of 22,500
  products) was off by about 0.005, ten times the tolerance at C = 2: the residual could not fall
  below it, each of those C ran to its 50 outer iterations, and the sweep spent three quarters of its
  time there. The rounding is measured at each C's start (the float32 and float64 gradients at its
  first point); where it exceeds a tenth of the tolerance, the C sums in float64 from a float64 copy
  of the features (twice their float32 size) and recomputes the scores it starts from. The Hessian
  stays float32 (any positive semi-definite matrix gives a descent direction) until the next item.
- Where the sweeps cannot solve a model (it stops at their cap), the Hessian is built in float64 and
  its models solved by an active-set method (``_active_set_minimiser``), for the rest of that C and
  every larger C after, nearer separability. On cell states of a briefly trained 4,096-unit model the
  matrices' eigenvalues span 10¹⁰ (4e-4 beside 1.2e7), and from C = 2^-3 on a model now and then,
  at C = 4 168 of 171, stopped at the cap 10 to 100 times short of its target: that C took 171 Newton
  steps and 27 s, against 13 steps and 1.2 s now. None of the benchmark's 11 synthetic cases reaches
  the cap, so they keep the float32 sweeps: on the hardest (σ = 2 scales, noise 0.05), float64 and the
  active-set method from the start took 8 times as long.
- Each C after the second starts from the previous two solutions' line, continued in log C, where
  that lowers the objective: at the large-C end the solutions move far from one C to the next, and
  the extrapolated start cut the coordinate sweeps by a fifth and the Hessian builds by a quarter.

The dense linear algebra other than syrk goes through torch (MKL) or compiled loops, not through
scipy's or numpy's OpenBLAS: on two cores OpenBLAS's threads and torch's OpenMP threads spin against
each other, and a 1,000 × 1,000 Cholesky factorisation took 0.3 to 2 s through scipy against 0.05 s
through torch (one C of a 4,096-wide sweep spent 3.5 s in ten of them).

docs/benchmarks.md (Probe) has the cases and liblinear's times beside newton's.

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

TOL = 1e-3
MAX_OUTER = 50
MAX_NEWTON = 20  # Newton steps on one working set before the full gradient is looked at again
MAX_SWEEPS = 200  # coordinate-descent sweeps on one quadratic model
MIN_WORKING_SET = 100
INNER = 0.3  # a working set is done when its residual is below this fraction of the full one
MODEL = 0.1  # the quadratic model is solved to this fraction of the residual it started from
ANDERSON = 5  # coordinate-descent sweeps between Anderson extrapolations (skglm's choice)
SLOW_STEP = 0.5  # a Newton step that leaves more than this of the residual rebuilds the Hessian
# Coordinate-descent sweeps between exact steps on the signs: 10 on working sets of up to 500
# coordinates, where a solve costs a few sweeps, 20 on larger ones, where it costs about 50.
EXACT_EVERY, EXACT_CHEAP_BELOW = (10, 20), 500
ROUNDING = 0.1  # sums in float64 where float32's rounding of the gradient exceeds this share of the tolerance
WHOLE_ABOVE = 0.25  # float64 working sets wider than this share of the features are not gathered
RIDGE_TRIES = 8  # tenfold ridges tried on an exact step: up to the mean of its diagonal
MAX_ACTIVE = 100  # Cholesky solves of the active-set method on one float64 model


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
    hessian = _LazyHessian()
    for C in Cs:
        start = (w_H, b, z_N)
        if len(solved) == 2 and solved[0][2] < solved[1][2] < C:
            start = _extrapolated_start(XT64_HN, s_N, C, start, solved)
        hessian.forget()  # each C's Hessian weighs its rows by that C's first step
        w_H, b, z_N, iterations, converged = _solve(
            XT_HN, XT64_HN, s_N, *start, 1.0 / C, tol, max_outer, hessian
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


def _residual(g: np.ndarray, w: np.ndarray, lam: float | np.ndarray) -> np.ndarray:
    """The minimum-norm subgradient of loss + lam·|w|, per coordinate: zero exactly at the minimum."""
    return np.where(
        w > 0, np.abs(g + lam), np.where(w < 0, np.abs(g - lam), np.maximum(np.abs(g) - lam, 0.0))
    )


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
        residual_H = _residual(g_H, w_H, lam)
        worst = max(float(residual_H.max()), float(_residual(np.array([g_b]), np.array([b]), lam)[0]))
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
        XT_WN = XT_HN[rows]
        if XG_HN is XT_HN:
            sums = _Sums(XT_WN)
        elif W.size > WHOLE_ABOVE * XG_HN.shape[0]:
            sums = _Sums(XG_HN, W)
        else:
            sums = _Sums(XG_HN[rows])
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
        worst = float(_residual(g_W, u_W, lam_W).max())
        if worst <= target:
            return u_W, z_N, step_count, False
        if step_count and worst > SLOW_STEP * last_worst:  # a poor step: the model's weights are stale
            hessian.forget()
        last_worst = worst
        matrix, model_target = hessian.on(XT_WN, W, D_N), MODEL * worst
        if not hessian.exact:
            d_W, sweeps = _model_minimiser(matrix, g_W, u_W, lam_W, model_target)
            if sweeps >= MAX_SWEEPS:  # past float32 and coordinate descent: float64 and exact steps
                hessian.go_exact()
                matrix = hessian.on(XT_WN, W, D_N)
        if hessian.exact:
            d_W, _ = _active_set_minimiser(matrix, g_W, u_W, lam_W, model_target)
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

    def __init__(self) -> None:
        self.D_N: torch.Tensor | None = None
        self.W = np.empty(0, dtype=np.intp)
        self.matrix = np.empty((1, 1), dtype=np.float32)
        self.exact = False

    def forget(self) -> None:
        """The next call builds the whole matrix again, with that call's weights."""
        self.D_N = None

    def go_exact(self) -> None:
        """Float64 from the next call on, which builds the whole matrix again."""
        self.exact = True
        self.forget()

    def on(self, XT_WN: torch.Tensor, W: np.ndarray, D_N: torch.Tensor) -> np.ndarray:
        if self.D_N is not None and np.array_equal(W, self.W):
            return self.matrix
        if self.exact:  # the float32 features' values, exactly: the products are summed in float64
            XT_WN = XT_WN.double()
        k = W.size
        matrix = np.empty((k + 1, k + 1), dtype=np.float64 if self.exact else np.float32)
        if self.D_N is None:
            self.D_N = D_N.to(XT_WN.dtype)
            _gram(XT_WN * self.D_N.sqrt(), out=matrix[:k, :k])
        else:
            shared = np.isin(W, self.W, assume_unique=True)
            old, new = np.flatnonzero(shared), np.flatnonzero(~shared)
            at = np.searchsorted(self.W, W[shared])
            matrix[np.ix_(old, old)] = self.matrix.take(at, 0).take(at, 1)
            if new.size:
                rows = ((XT_WN[torch.from_numpy(new).to(XT_WN.device)] * self.D_N) @ XT_WN.T).cpu().numpy()
                matrix[new, :k] = rows
                matrix[:k, new] = rows.T
        matrix[:k, k] = matrix[k, :k] = (XT_WN @ self.D_N).cpu().numpy()
        matrix[k, k] = float(self.D_N.double().sum())
        self.W, self.matrix = W, matrix
        return matrix


def _gram(A_KN: torch.Tensor, out: np.ndarray | None = None) -> np.ndarray:
    """A Aᵀ [K, K] in A's dtype (float32 or float64), written into ``out`` when given: syrk on the CPU
    (one triangle, half the work of a product), mirrored."""
    K = A_KN.shape[0]
    out = (
        np.empty((K, K), dtype=np.float64 if A_KN.dtype == torch.float64 else np.float32)
        if out is None
        else out
    )
    if A_KN.device.type != "cpu":
        out[:] = (A_KN @ A_KN.T).cpu().numpy()
    elif 0 in A_KN.shape:  # BLAS refuses an empty matrix with a message on stdout, which --json owns
        out[:] = 0.0
    else:
        syrk = scipy.linalg.blas.dsyrk if A_KN.dtype == torch.float64 else scipy.linalg.blas.ssyrk
        # Aᵀ of a row-major [K, N] array is column-major [N, K]: what syrk reads without a copy
        # (trans=1). Its column-major upper triangle is, read row-major, the lower one.
        lower = syrk(1.0, A_KN.numpy().T, trans=1).T
        _mirror(lower, out)
    return out


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


def _model_minimiser(
    hessian: np.ndarray,
    g: np.ndarray,
    w: np.ndarray,
    lam: np.ndarray,
    target: float,
    anderson: int = ANDERSON,
    exact_every: int | None = None,
) -> tuple[np.ndarray, int]:
    """The step d minimising g·d + ½ dᵀ hessian d + Σ lam|w + d|, to a residual ≤ ``target``, and the
    sweeps it took.

    Cyclic coordinate descent; sweeps go over the non-zero coordinates until they settle, then over all.
    Every ``anderson`` sweeps of one kind, the last iterates are extrapolated (Anderson acceleration of
    coordinate descent, Bertrand & Massias 2021) and the extrapolation is kept only if it lowers the
    model: on correlated columns the sweeps creep along the model's long, flat valley, and the
    extrapolation jumps along it. ``anderson`` 0 turns it off.

    Every ``exact_every`` sweeps (0: never; by default EXACT_EVERY's for the model's size) the model
    also takes its exact minimiser on the current signs (``_orthant_step``). Sweeps alone stall on two
    kinds of model: cell states of a model trained briefly hold nearly constant units, nearly collinear
    with each other and the intercept, on which sweeps stop at their cap even on 30 coordinates; and
    the large-C end of a 4,096-wide IMDB-sized sweep (working sets of about 3,800 strongly correlated
    columns), where every model stopped at the cap of 200 sweeps, each Newton step left half its
    residual, and the sweep took over twice as long.
    Past a few hundred coordinates one solve costs about 50 sweeps' time, so they are 20 sweeps apart
    there: at 10 they were a third of a 4,096-wide SST-sized sweep, at 40 the IMDB-sized one slowed
    again. On small models a solve costs a few sweeps, and the collinear ones need them 10 apart.
    """
    k = g.size
    if exact_every is None:
        exact_every = EXACT_EVERY[k > EXACT_CHEAP_BELOW]
    hd = np.zeros(k)  # hessian @ (u - w)
    diagonal = np.diag(hessian).astype(np.float64) + 1e-12
    u = w.copy()
    order = np.arange(k)
    # The iterates since the last extrapolation (row 0 its start) and their hessian @ (u - w): the
    # model is linear in them, so an extrapolation's own product costs nothing.
    us, hds = np.empty((anderson + 1, k)), np.empty((anderson + 1, k))
    us[0], hds[0], kept = u, hd, 1
    sweeps = 0
    while sweeps < MAX_SWEEPS:
        _sweep(hessian, g, lam, diagonal, order, u, hd)
        sweeps += 1
        if anderson:
            us[kept], hds[kept], kept = u, hd, kept + 1
            if kept == anderson + 1:
                _extrapolate(us, hds, g, w, lam, u, hd)
                us[0], hds[0], kept = u, hd, 1
        if exact_every and sweeps % exact_every == 0 and _orthant_step(hessian, g, w, lam, u, hd):
            us[0], hds[0], kept = u, hd, 1  # a jump: the extrapolation starts again from here
        residual = _residual(g + hd, u, lam)
        if residual.max() <= target:
            break
        support = np.flatnonzero(u)
        settled = residual[support].max(initial=0.0) <= target
        next_order = np.arange(k) if settled else support
        if next_order.size != order.size:  # another map from here on: its own history
            us[0], hds[0], kept = u, hd, 1
        order = next_order
    return u - w, sweeps


def _orthant_step(
    hessian: np.ndarray, g: np.ndarray, w: np.ndarray, lam: np.ndarray, u: np.ndarray, hd: np.ndarray
) -> bool:
    """Moves ``u`` (and ``hd``) in place toward the model's minimiser with the signs of u held; says
    whether the model fell.

    Within the signs' orthant the model is a smooth quadratic plus a linear term: its minimiser there is
    a Cholesky solve on the support, float64, and the model falls all along the segment to it. Where
    the step takes coordinates through zero, two points keep the signs: the segment cut where the first
    of them reaches zero, and the whole step with those coordinates set to zero (a projection, not
    always lower); the lower wins. The cut alone moved one coordinate to zero per solve, and on the
    large working sets of the IMDB-sized sweep took three times as many solves.
    """
    S = np.flatnonzero(u)
    if S.size == 0:
        return False
    sign = np.sign(u[S])
    step = _newton_on_signs(hessian, S, g[S] + hd[S] + lam[S] * sign)
    if step is None:
        return False
    crossing = np.flatnonzero((u[S] + step) * sign < 0)
    candidates = [u[S] + step]
    if crossing.size:
        candidates[0][crossing] = 0.0
        ratios = u[S][crossing] / -step[crossing]
        cut = u[S] + ratios.min() * step
        cut[crossing[np.argmin(ratios)]] = 0.0
        candidates.append(cut)
    best, best_value = None, _model_value(u, hd, g, w, lam)
    for u_S in candidates:
        hd_new = hd.copy()
        _add_rows(hessian, S, u_S - u[S], hd_new)
        u_new = u.copy()
        u_new[S] = u_S
        value = _model_value(u_new, hd_new, g, w, lam)
        if value < best_value:  # neither, where the ridge or rounding left the model no lower
            best, best_value = (u_new, hd_new), value
    if best is None:
        return False
    u[:], hd[:] = best
    return True


def _newton_on_signs(hessian: np.ndarray, S: np.ndarray, slope_S: np.ndarray) -> np.ndarray | None:
    """The step on the coordinates ``S`` to the minimiser of the model with their signs held, whose slope
    there (the model's gradient plus lam times the signs) is ``slope_S``: a Cholesky solve, float64, with
    a ridge; None where no ridge tried makes the matrix factorise."""
    H_SS = hessian[np.ix_(S, S)].astype(np.float64)
    # A ridge at float32's resolution: nearly collinear columns leave H_SS numerically singular. The
    # float32 matrix can be indefinite by more than that (cell states of a briefly trained 4,096-unit
    # model at C = 4: eigenvalues down to -0.04 beside 1.8e7), and there every factorisation failed,
    # the model was left to the sweeps, and the C ran to its outer cap (115 s; 19 s with this). So the
    # ridge grows tenfold until the factorisation succeeds: a damped step, checked by the caller.
    ridge = 1e-7 * float(np.trace(H_SS)) / S.size + 1e-300
    diagonal = np.diag_indices_from(H_SS)
    H_SS[diagonal] += ridge
    for _ in range(RIDGE_TRIES):
        # torch's LAPACK, not scipy's: scipy's OpenBLAS threads spin against torch's OpenMP threads on
        # few cores, and a 1,000 × 1,000 factorisation took 0.3 to 2 s there against torch's 0.05 s.
        factor, info = torch.linalg.cholesky_ex(torch.from_numpy(H_SS))
        if not info:
            return -torch.cholesky_solve(torch.from_numpy(slope_S)[:, None], factor)[:, 0].numpy()
        H_SS[diagonal] += 9 * ridge
        ridge *= 10
    return None


def _active_set_minimiser(
    hessian: np.ndarray,
    g: np.ndarray,
    w: np.ndarray,
    lam: np.ndarray,
    target: float,
    max_steps: int = MAX_ACTIVE,
) -> tuple[np.ndarray, int]:
    """The step d minimising g·d + ½ dᵀ hessian d + Σ lam|w + d| (as ``_model_minimiser``), to a residual
    ≤ ``target``, and the solves it took: an active-set method, for models too ill-conditioned for
    coordinate descent.

    Feature-sign search (Lee, Battle, Raina & Ng 2007): while the non-zero coordinates are not yet
    optimal, step to the model's minimiser with their signs held (a Cholesky solve), or to the lowest
    point of that segment where a coordinate reaches zero (it leaves the set); once they are, bring in
    every zero coordinate that violates optimality, each with the sign its gradient asks for (one at a
    time, as the paper does, the sweep of real 4,096-wide cell states took 1.7 times as long: more
    solves). Every step lowers the model, whatever the matrix's conditioning: on those cell states at
    C = 4, coordinate descent with exact steps stopped at its cap of 200 sweeps on 168 of 171 models,
    10 to 100 times short of the target; this solved every model of the sweep, in 1 to 53 solves.
    """
    k = g.size
    u, hd = w.copy(), np.zeros(k)
    solves = 0
    while solves < max_steps:
        slope = g + hd
        residual = _residual(slope, u, lam)
        if residual.max() <= target:
            break
        sign = np.sign(u)
        S = np.flatnonzero(u)
        if residual[S].max(initial=0.0) <= target:
            zeros = np.flatnonzero((u == 0) & (residual > target))
            sign[zeros] = -np.sign(slope[zeros])
            S = np.sort(np.concatenate([S, zeros]))
        step = None
        while S.size:
            step = _newton_on_signs(hessian, S, slope[S] + lam[S] * sign[S])
            solves += 1
            # A coordinate brought in that the step moves against its sign would raise the model: it
            # stays out, and the rest are solved again.
            wrong = (u[S] == 0) & (step * sign[S] < 0) if step is not None else np.zeros(S.size, bool)
            if not wrong.any():
                break
            S, step = S[~wrong], None
        if step is None:
            break
        # The model along the segment: t·a + ½t²·b + lam·(|u_S + t·step| - |u_S|), lowest at its end or
        # where a coordinate reaches zero.
        u_S, lam_S = u[S], lam[S]
        a, b = float(slope[S] @ step), float(step @ (hessian[np.ix_(S, S)] @ step))
        leaving = np.flatnonzero((u_S != 0) & (u_S * step < 0))
        ts = np.append(-u_S[leaving] / step[leaving], 1.0)
        ts = ts[(ts > 0) & (ts <= 1)]
        values = [t * a + 0.5 * t * t * b + lam_S @ (np.abs(u_S + t * step) - np.abs(u_S)) for t in ts]
        best = int(np.argmin(values))
        if values[best] >= 0:  # no descent left at float precision
            break
        t = ts[best]
        new_S = u_S + t * step
        if t < 1:  # the coordinates that reach zero there leave exactly
            new_S[leaving[np.isclose(-u_S[leaving] / step[leaving], t, rtol=1e-12, atol=0)]] = 0.0
        _add_rows(hessian, S, new_S - u_S, hd)
        u[S] = new_S
    return u - w, solves


def _model_value(u: np.ndarray, hd: np.ndarray, g: np.ndarray, w: np.ndarray, lam: np.ndarray) -> float:
    """g·d + ½ dᵀ hessian d + Σ lam|u| for d = u - w, from hd = hessian @ d (the model up to a constant)."""
    d = u - w
    return float(g @ d + 0.5 * (d @ hd) + lam @ np.abs(u))


def _extrapolate(
    us: np.ndarray,
    hds: np.ndarray,
    g: np.ndarray,
    w: np.ndarray,
    lam: np.ndarray,
    u: np.ndarray,
    hd: np.ndarray,
) -> bool:
    """Replaces ``u`` (and ``hd``) in place by the Anderson extrapolation of the iterates ``us`` if that
    lowers the model; says whether it did.

    The weights c (summing to 1) minimise |Σ c_i r_i| over the differences r_i of successive iterates;
    the extrapolation is Σ c_i us[i + 1]. A guard, not a proof of descent: it is kept only where the
    model says it is better than the last sweep's point.
    """
    R = np.diff(us, axis=0)
    gram = R @ R.T
    # A ridge of the gram's own scale: successive differences are nearly parallel near convergence.
    gram[np.diag_indices_from(gram)] += 1e-10 * np.trace(gram) + 1e-300
    try:
        c = np.linalg.solve(gram, np.ones(len(gram)))
    except np.linalg.LinAlgError:
        return False
    if not np.isfinite(c).all() or c.sum() == 0:
        return False
    c /= c.sum()
    u_e, hd_e = c @ us[1:], c @ hds[1:]
    if _model_value(u_e, hd_e, g, w, lam) >= _model_value(u, hd, g, w, lam):
        return False
    u[:], hd[:] = u_e, hd_e
    return True


# Compiled: the sweep is a scalar loop over coordinates, each reading one Hessian row; in Python it was
# 88% of the solver's time at the large-C end (k ≈ 1,000–2,000, tens of sweeps per Newton step).
# cache=True keeps the machine code beside the source, so only the first run pays the compile.
@numba.njit(cache=True)
def _sweep(
    hessian: np.ndarray,
    g: np.ndarray,
    lam: np.ndarray,
    diagonal: np.ndarray,
    order: np.ndarray,
    u: np.ndarray,
    hd: np.ndarray,
) -> None:
    """One cyclic coordinate-descent sweep over ``order``, updating ``u`` and ``hd`` in place."""
    k = hd.size
    for j in order:
        a, u_old = diagonal[j], u[j]
        centre = u_old - (g[j] + hd[j]) / a
        shrink = lam[j] / a
        u_new = centre - shrink if centre > shrink else centre + shrink if centre < -shrink else 0.0
        if u_new != u_old:
            u[j] = u_new
            delta = u_new - u_old
            for i in range(k):
                hd[i] += delta * hessian[j, i]


@numba.njit(cache=True)
def _add_rows(hessian: np.ndarray, rows: np.ndarray, delta: np.ndarray, hd: np.ndarray) -> None:
    """hd += hessian[rows].T @ delta in place (= hessian[:, rows] @ delta: the matrix is symmetric),
    reading whole rows as the sweep does, in float64 without a converted copy of the matrix."""
    k = hd.size
    for n in range(rows.size):
        j, step = rows[n], delta[n]
        for i in range(k):
            hd[i] += step * hessian[j, i]
