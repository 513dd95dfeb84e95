"""The L1 logistic-regression path solvers the probe chooses from (``fit_probe(solver=...)``).

All three minimise liblinear's objective, its intercept penalised too, at each C of an ascending sweep,
and yield each C's probe as a ``PathPoint`` as soon as it is solved:

- ``liblinear`` (liblinear.py): the paper's solver, scikit-learn's liblinear, one fit per C; the reference.
- ``newton`` (newton.py): a warm-started working-set proximal Newton path (BLAS threads or a GPU for
  the products); the default.
- ``torch`` (fista.py): a warm-started FISTA path in PyTorch (CPU threads or a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Solver = Literal["liblinear", "newton", "torch"]
SOLVERS: tuple[Solver, ...] = ("liblinear", "newton", "torch")


@dataclass(frozen=True)
class PathPoint:
    """The probe at one C, in raw feature units: P(positive) = sigmoid(coef·x + intercept)."""

    C: float
    coef: np.ndarray  # float64 [H]
    intercept: float
    iterations: int
    converged: bool
