"""Synthetic features built like cell states, for the probe benchmark (``benchmarks/probe.py``): its
splits sized like SST's and IMDB's, in the conditionings a probe meets (well conditioned, heavy-tailed
unit scales, near a low-dimensional manifold), seeded so that every run and machine sees the same
arrays. Real cell states are ``cell_states.py``'s."""

from __future__ import annotations

import numpy as np

ROWS = {"sst": (6920, 872, 1821), "imdb": (22500, 2500, 25000)}
LATENT = 64  # shared factors behind every column: the features' correlation
# Per-column scale factors: uniform as in a well-conditioned case, log-normal as the heavy-tailed unit
# scales of real cell states (σ = 2: a few units thousands of times larger than others).
SCALES = {
    "uniform": lambda rng, n: rng.uniform(0.2, 3.0, n),
    "lognormal-1": lambda rng, n: rng.lognormal(0.0, 1.0, n),
    "lognormal-2": lambda rng, n: rng.lognormal(0.0, 2.0, n),
}
Splits = list[tuple[np.ndarray, np.ndarray]]


def cell_state_like(
    rows: tuple[int, ...], width: int, *, scales: str = "uniform", noise: float = 0.5, seed: int = 0
) -> Splits:
    """Train, dev and test splits of synthetic features (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    mixing = (rng.standard_normal((LATENT, width)) / 4).astype(np.float32)
    scale_H = SCALES[scales](rng, width).astype(np.float32)
    w_true = rng.choice([-2.0, 2.0], 8)
    splits = []
    for n in rows:
        T = rng.standard_normal((n, LATENT)).astype(np.float32) @ mixing
        T = np.tanh(T + noise * rng.standard_normal((n, width)).astype(np.float32))
        # The labels follow the units before scaling: the same answer whatever the scales.
        y = (rng.random(n) < 1 / (1 + np.exp(-(T[:, :8] @ w_true)))).astype(np.int64)
        splits.append((T * scale_H, y))
    return splits


def near_low_rank(
    rows: tuple[int, ...],
    width: int,
    rank: int,
    *,
    scales: str = "lognormal-1",
    noise: float = 0.05,
    seed: int = 0,
) -> Splits:
    """Train, dev and test splits of features near a ``rank``-dimensional manifold, as a trained model's
    cell states are: each unit a tanh of the same ``rank`` latent factors, plus independent noise of
    ``noise``, then scaled per unit (``SCALES``); labels from a logistic model on a sparse direction in
    the latent space (its first ``min(4, rank)`` factors), so that every unit carries some of the answer
    and none all of it."""
    rng = np.random.default_rng(seed)
    # Pre-activations of unit variance: tanh bends them without saturating most units.
    mixing = (rng.standard_normal((rank, width)) / np.sqrt(rank)).astype(np.float32)
    scale_H = SCALES[scales](rng, width).astype(np.float32)
    w_true = rng.choice([-1.5, 1.5], min(4, rank))
    splits = []
    for n in rows:
        Z = rng.standard_normal((n, rank)).astype(np.float32)
        T = np.tanh(Z @ mixing) + noise * rng.standard_normal((n, width)).astype(np.float32)
        y = (rng.random(n) < 1 / (1 + np.exp(-(Z[:, : w_true.size] @ w_true)))).astype(np.int64)
        splits.append((T * scale_H, y))
    return splits
