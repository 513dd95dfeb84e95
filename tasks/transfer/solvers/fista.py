"""The ``torch`` solver: an L1 logistic-regression path by FISTA in PyTorch, on CPU threads or a GPU.

For each C, ascending, it minimises liblinear's objective divided by C·N (same minimiser):

    mean_i log(1 + exp(-s_i (w·x_i + b)))  +  ||w||_1 / (C·N),        s_i = ±1

plus |b| / (C·N): liblinear penalises the intercept as one more feature of value 1, and at the small-C
end that penalty changes which probe wins. It is solved by FISTA (accelerated proximal gradient,
Beck & Teboulle 2009) with adaptive restart (O'Donoghue & Candès 2015) on columns divided by their
root mean square ρ_j (not centred, which would mix b into every weight's penalty); the L1 weight of
column j then becomes 1/(C·N·ρ_j), so the problem and its solution are exactly the raw-feature ones,
only better conditioned. Each C starts from the previous
C's solution (a warm-started regularisation path).

Convergence: a C is done when the proximal-gradient mapping, the optimality residual that is zero
exactly at the minimum, has max-norm ≤ ``tol`` × the median L1 weight (so the tolerance shrinks
with the penalty as C grows), or after ``max_iter`` steps.
All work is dense matrix products, so torch's CPU threads or a CUDA device run it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from tasks.transfer.solvers import PathPoint

TOL = 1e-3
MAX_ITER = 3000


def l1_logistic_path(
    X_NH: np.ndarray,
    y_N: np.ndarray,
    Cs: tuple[float, ...],
    *,
    device: torch.device | str = "cpu",
    tol: float = TOL,
    max_iter: int = MAX_ITER,
) -> Iterator[PathPoint]:
    """The L1 logistic probe at each C of ``Cs`` (ascending), warm-started along the path.

    Yields each C's probe as soon as it is solved (for progress). Deterministic for the same inputs on
    the same device: no sampling, a fixed sequence of reductions.
    """
    device = torch.device(device)
    # A copy: the input may be a read-only memory map, which torch will not wrap.
    X = torch.from_numpy(np.array(X_NH, dtype=np.float32)).to(device)
    s_N = torch.from_numpy(np.asarray(y_N, dtype=np.float32) * 2 - 1).to(device)  # 0/1 → -1/+1
    N, H = X.shape
    rms_H = X.square().mean(0).sqrt().clamp_min(1e-6)  # an all-zero column stays zero
    Xs = X / rms_H  # [N, H], every column of mean square 1
    del X
    # The gradient of the mean logistic loss is (1/4)·||[Xs 1]||²/N-Lipschitz; the norm by power iteration.
    step = 1.0 / (0.25 * _squared_norm(Xs) / N)

    v_H = torch.zeros(H, device=device, dtype=Xs.dtype)  # weights on the scaled columns
    b = torch.zeros((), device=device, dtype=Xs.dtype)
    for C in Cs:
        lam_H = 1.0 / (C * N * rms_H)  # the raw-unit L1 weight, seen through the scaling
        v_H, b, iterations, converged = _fista(Xs, s_N, v_H, b, lam_H, 1.0 / (C * N), step, tol, max_iter)
        coef_H = v_H / rms_H
        intercept = b
        yield PathPoint(
            C=float(C),
            coef=coef_H.double().cpu().numpy(),
            intercept=float(intercept),
            iterations=iterations,
            converged=converged,
        )


def _fista(
    Xs: torch.Tensor,
    s_N: torch.Tensor,
    v_H: torch.Tensor,
    b: torch.Tensor,
    lam_H: torch.Tensor,
    lam_b: float,
    step: float,
    tol: float,
    max_iter: int,
) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    N = Xs.shape[0]

    def gradient(u_H: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        margin_N = s_N * (Xs @ u_H + c)
        r_N = -s_N * torch.sigmoid(-margin_N) / N  # d mean-loss / d score
        return Xs.T @ r_N, r_N.sum()

    threshold = tol * float(lam_H.median())
    z_H, c, t = v_H.clone(), b.clone(), 1.0
    for iteration in range(1, max_iter + 1):
        g_H, g_b = gradient(z_H, c)
        v_next = _soft_threshold(z_H - step * g_H, step * lam_H)
        b_next = _soft_threshold(c - step * g_b, torch.tensor(step * lam_b))
        # Gradient mapping at z: zero exactly at the minimum; the stopping rule.
        residual = max(float((z_H - v_next).abs().max()), abs(float(c - b_next))) / step
        if residual <= threshold:
            return v_next, b_next, iteration, True
        # Adaptive restart: momentum is dropped when it points uphill.
        uphill = float(((z_H - v_next) * (v_next - v_H)).sum() + (c - b_next) * (b_next - b)) > 0
        t_next = 1.0 if uphill else (1 + (1 + 4 * t * t) ** 0.5) / 2
        momentum = 0.0 if uphill else (t - 1) / t_next
        z_H = v_next + momentum * (v_next - v_H)
        c = b_next + momentum * (b_next - b)
        v_H, b, t = v_next, b_next, t_next
    return v_H, b, max_iter, False


def _soft_threshold(u_H: torch.Tensor, k_H: torch.Tensor) -> torch.Tensor:
    return torch.sign(u_H) * (u_H.abs() - k_H).clamp_min(0)


def _squared_norm(X: torch.Tensor, num_iter: int = 50) -> float:
    """The largest eigenvalue of [X 1]ᵀ[X 1] by power iteration, from a fixed start (deterministic)."""
    u_H = torch.ones(X.shape[1], device=X.device, dtype=X.dtype) / X.shape[1] ** 0.5
    u_b = torch.zeros((), device=X.device, dtype=X.dtype)
    value = torch.zeros((), device=X.device, dtype=X.dtype)
    for _ in range(num_iter):
        z_N = X @ u_H + u_b
        w_H, w_b = X.T @ z_N, z_N.sum()
        value = (w_H.square().sum() + w_b * w_b).sqrt()
        u_H, u_b = w_H / value, w_b / value
    return float(value) * 1.01  # a margin over the estimate, which approaches from below
