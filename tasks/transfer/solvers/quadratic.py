"""The quadratic models of the proximal Newton solver (``newton``): the step d minimising

    g·d + ½ dᵀ H d + Σ lam |w + d|

on a working set's Hessian H, to a residual below a target.

``model_minimiser`` is cyclic coordinate descent (compiled with numba, one matrix row per changed
coordinate) over the non-zero coordinates until they settle, then over all, with two accelerations:
Anderson extrapolation of the last iterates (Bertrand & Massias 2021, as skglm does), kept where it
lowers the model, because on correlated columns the sweeps creep along the model's long flat valley;
and exact steps on the current signs (``orthant_step``), a Cholesky solve, because where nearly
constant units are collinear with the intercept the sweeps make no headway at all. Where the float32
matrix is indefinite past the solve's ridge, the ridge grows until it factorises.
``active_set_minimiser`` (feature-sign search on a float64 matrix) takes over where the sweeps stop at
``MAX_SWEEPS``: matrices whose eigenvalues span more than float32 resolves; its solves share one
Cholesky factor, updated as coordinates join and leave (``cholesky.FactorOnSet``). docs/transfer.md (Solvers)
has the measurements behind each choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numba
import numpy as np
import torch

from tasks.transfer.solvers.cholesky import FactorOnSet

MAX_SWEEPS = 200  # coordinate-descent sweeps on one quadratic model
ANDERSON = 5  # coordinate-descent sweeps between Anderson extrapolations (skglm's choice)
# Coordinate-descent sweeps between exact steps on the signs: 10 on working sets of up to 500
# coordinates, where a solve costs a few sweeps, 20 on larger ones, where it costs about 50.
EXACT_EVERY, EXACT_CHEAP_BELOW = (10, 20), 500
MAX_ACTIVE = 100  # Cholesky solves of the active-set method on one float64 model


def min_subgradient(g: np.ndarray, w: np.ndarray, lam: float | np.ndarray) -> np.ndarray:
    """The minimum-norm subgradient of loss + lam·|w|, per coordinate: zero exactly at the minimum."""
    return np.where(
        w > 0, np.abs(g + lam), np.where(w < 0, np.abs(g - lam), np.maximum(np.abs(g) - lam, 0.0))
    )


def model_minimiser(
    hessian: np.ndarray,
    g: np.ndarray,
    w: np.ndarray,
    lam: np.ndarray,
    target: float,
    anderson: int = ANDERSON,
    exact_every: int | None = None,
    factor: FactorOnSet | None = None,
) -> tuple[np.ndarray, int]:
    """The step d minimising g·d + ½ dᵀ hessian d + Σ lam|w + d|, to a residual ≤ ``target``, and the
    sweeps it took.

    Cyclic coordinate descent; sweeps go over the non-zero coordinates until they settle, then over all.
    Every ``anderson`` sweeps of one kind, the last iterates are extrapolated (Anderson acceleration of
    coordinate descent, Bertrand & Massias 2021) and the extrapolation is kept only if it lowers the
    model: on correlated columns the sweeps creep along the model's long, flat valley, and the
    extrapolation jumps along it. ``anderson`` 0 turns it off.

    Every ``exact_every`` sweeps (0: never; by default EXACT_EVERY's for the model's size) the model
    also takes its exact minimiser on the current signs (``orthant_step``). Sweeps alone stall on two
    kinds of model: cell states of a model trained briefly hold nearly constant units, nearly collinear
    with each other and the intercept, on which sweeps stop at their cap even on 30 coordinates; and
    the large-C end of a 4,096-wide IMDB-sized sweep (working sets of about 3,800 strongly correlated
    columns), where every model stopped at the cap of 200 sweeps, each Newton step left half its
    residual, and the sweep took over twice as long.
    Past a few hundred coordinates one solve costs about 50 sweeps' time, so they are 20 sweeps apart
    there: at 10 they were a third of a 4,096-wide SST-sized sweep, at 40 the IMDB-sized one slowed
    again. On small models a solve costs a few sweeps, and the collinear ones need them 10 apart.

    ``factor``, a ``FactorOnSet`` holding ``hessian``'s form, carries the exact steps' Cholesky factor
    from one call to the next: the models of one C share their Hessian's entries and their supports
    move by a few coordinates, so a solve updates the factor (about k² operations) instead of
    factoring afresh (k³/3). Without one, the model's exact steps share one of their own.
    """
    factor = FactorOnSet(hessian) if factor is None else factor
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
                extrapolate(us, hds, g, w, lam, u, hd)
                us[0], hds[0], kept = u, hd, 1
        if exact_every and sweeps % exact_every == 0 and orthant_step(hessian, g, w, lam, u, hd, factor):
            us[0], hds[0], kept = u, hd, 1  # a jump: the extrapolation starts again from here
        residual = min_subgradient(g + hd, u, lam)
        if residual.max() <= target:
            break
        support = np.flatnonzero(u)
        settled = residual[support].max(initial=0.0) <= target
        next_order = np.arange(k) if settled else support
        if next_order.size != order.size:  # another map from here on: its own history
            us[0], hds[0], kept = u, hd, 1
        order = next_order
    return u - w, sweeps


def orthant_step(
    hessian: np.ndarray,
    g: np.ndarray,
    w: np.ndarray,
    lam: np.ndarray,
    u: np.ndarray,
    hd: np.ndarray,
    factor: FactorOnSet,
) -> bool:
    """Moves ``u`` (and ``hd``) in place toward the model's minimiser with the signs of u held, through
    ``factor`` (on ``hessian``'s form); says whether the model fell.

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
    step = _newton_on_signs(S, g[S] + hd[S] + lam[S] * sign, factor)
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
    best, best_value = None, model_value(u, hd, g, w, lam)
    for u_S in candidates:
        hd_new = hd.copy()
        _add_rows(hessian, S, u_S - u[S], hd_new)
        u_new = u.copy()
        u_new[S] = u_S
        value = model_value(u_new, hd_new, g, w, lam)
        if value < best_value:  # neither, where the ridge or rounding left the model no lower
            best, best_value = (u_new, hd_new), value
    if best is None:
        return False
    u[:], hd[:] = best
    return True


def _newton_on_signs(S: np.ndarray, slope_S: np.ndarray, factor: FactorOnSet) -> np.ndarray | None:
    """The step on the coordinates ``S`` to the minimiser of the model with their signs held, whose slope
    there (the model's gradient plus lam times the signs) is ``slope_S``: a Cholesky solve, float64, with
    a ridge (``cholesky.ridged_cholesky``), through ``factor`` (on the model's Hessian, updated from its
    last set); None where no ridge tried makes the matrix factorise.

    Without the ridge grown on failure, cell states of a briefly trained 4,096-unit model at C = 4 left
    every model to the sweeps and the C ran to its outer cap (115 s; 19 s with it)."""
    with one_thread():
        solution = factor.solve(S, slope_S)
    return None if solution is None else -solution


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread within: on the 2-core machine, shared, an exact step on 900 coordinates took
    about 22 ms on one thread and 70 to 275 ms on two, most of it in torch's ``cholesky_solve`` then
    (3.5 ms against 30 to 180), whose threads wait on each other for a core (docs/benchmarks.md,
    Probe); the factorisations, torch's still, are the same kind of call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def active_set_minimiser(
    hessian: np.ndarray,
    g: np.ndarray,
    w: np.ndarray,
    lam: np.ndarray,
    target: float,
    max_steps: int = MAX_ACTIVE,
    factor: FactorOnSet | None = None,
) -> tuple[np.ndarray, int]:
    """The step d minimising g·d + ½ dᵀ hessian d + Σ lam|w + d| (as ``model_minimiser``), to a residual
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
    Successive solves differ by a coordinate or two, so they share one factor, updated rather than
    factored afresh (``FactorOnSet``): about k² operations a solve instead of k³/3. ``factor``, one
    holding ``hessian``'s form (``model_minimiser``'s), carries it over from the models before.
    """
    k = g.size
    u, hd = w.copy(), np.zeros(k)
    factor = FactorOnSet(hessian) if factor is None else factor
    step_hd = np.empty(k)
    solves = 0
    while solves < max_steps:
        slope = g + hd
        residual = min_subgradient(slope, u, lam)
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
            with one_thread():
                solution = factor.solve(S, slope[S] + lam[S] * sign[S])
            step = None if solution is None else -solution
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
        # where a coordinate reaches zero. hessian[:, S] @ step, once: b and hd's move both read it.
        step_hd[:] = 0.0
        _add_rows(hessian, S, step, step_hd)
        u_S, lam_S = u[S], lam[S]
        a, b = float(slope[S] @ step), float(step @ step_hd[S])
        leaving = np.flatnonzero((u_S != 0) & (u_S * step < 0))
        ts = np.append(-u_S[leaving] / step[leaving], 1.0)
        ts = ts[(ts > 0) & (ts <= 1)]
        values = [t * a + 0.5 * t * t * b + lam_S @ (np.abs(u_S + t * step) - np.abs(u_S)) for t in ts]
        best = int(np.argmin(values))
        if values[best] >= 0:  # no descent left at float precision
            break
        t = ts[best]
        new_S = u_S + t * step
        hd += t * step_hd
        if t < 1:  # the coordinates that reach zero there leave exactly
            zeroed = leaving[np.isclose(-u_S[leaving] / step[leaving], t, rtol=1e-12, atol=0)]
            _add_rows(hessian, S[zeroed], -new_S[zeroed], hd)
            new_S[zeroed] = 0.0
        u[S] = new_S
    return u - w, solves


def model_value(u: np.ndarray, hd: np.ndarray, g: np.ndarray, w: np.ndarray, lam: np.ndarray) -> float:
    """g·d + ½ dᵀ hessian d + Σ lam|u| for d = u - w, from hd = hessian @ d (the model up to a constant)."""
    d = u - w
    return float(g @ d + 0.5 * (d @ hd) + lam @ np.abs(u))


def extrapolate(
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
    if model_value(u_e, hd_e, g, w, lam) >= model_value(u, hd, g, w, lam):
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
