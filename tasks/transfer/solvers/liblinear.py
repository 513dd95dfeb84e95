"""The reference L1 logistic-regression path: scikit-learn's liblinear, one fit per C, as the paper's code.

Exact coordinate descent whose only randomness is seeded, so a fit is reproducible, and fast on
25k × 4096 dense features without any rescaling, which saga would need to converge on raw cell states.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from sklearn.linear_model import LogisticRegression

from tasks.transfer.solvers import PathPoint

# liblinear's default of 100 Newton steps is short for raw, unscaled cell states at the large-C end.
MAX_ITER = 1000
TOL = 1e-4  # scikit-learn's default: the paper's solver as it ships


def l1_logistic_path(
    X_NH: np.ndarray,
    y_N: np.ndarray,
    Cs: tuple[float, ...],
    *,
    seed: int = 0,
    tol: float = TOL,
    max_iter: int = MAX_ITER,
) -> Iterator[PathPoint]:
    """The L1 logistic probe at each C of ``Cs``, each fitted from scratch; ``seed`` is liblinear's
    random_state, ``tol`` and ``max_iter`` its stopping rule. A generator, so each C's progress line
    comes as soon as its fit ends."""
    for C in Cs:
        # l1_ratio=1 is pure L1; scikit-learn 1.8 deprecated penalty="l1" for it (FutureWarning).
        model = LogisticRegression(
            C=C, l1_ratio=1.0, solver="liblinear", tol=tol, max_iter=max_iter, random_state=seed
        )
        model.fit(X_NH, y_N)
        iterations = int(np.max(model.n_iter_))
        yield PathPoint(
            C=float(C),
            coef=model.coef_.ravel().astype(np.float64),
            intercept=float(model.intercept_.ravel()[0]),
            iterations=iterations,
            converged=iterations < max_iter,
        )
