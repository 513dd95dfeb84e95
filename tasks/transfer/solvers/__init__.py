"""The L1 logistic-regression path solvers the probe chooses from (``fit_probe(solver=...)``).

Both minimise liblinear's objective, its intercept penalised too, at each C of an ascending sweep,
and yield each C's probe as a ``PathPoint`` as soon as it is solved:

- ``liblinear`` (liblinear.py): the paper's solver, scikit-learn's liblinear, one fit per C; the reference.
- ``newton`` (newton.py): a warm-started working-set proximal Newton path (BLAS threads or a GPU for
  the products); the default.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the solvers' names are read where numpy is not loaded yet (the CLI's --help)
    import numpy as np

Solver = Literal["liblinear", "newton"]
SOLVERS: tuple[Solver, ...] = typing.get_args(Solver)
# newton solves liblinear's objective 5-10x faster over the sweep (docs/transfer.md); liblinear is the
# reference a caller asks for by name.
DEFAULT_SOLVER: Solver = "newton"


@dataclass(frozen=True)
class PathPoint:
    """The probe at one C, in raw feature units: P(positive) = sigmoid(coef·x + intercept)."""

    C: float
    coef: np.ndarray  # float64 [H]
    intercept: float
    iterations: int
    converged: bool
