"""ASHA's promotion rule (Li et al. 2018, *A System for Massively Parallel Hyperparameter Tuning*,
Algorithm 2), as a plain function of the trials' standing: no Optuna, no storage, no clock.

A trial that reaches a rung stops there, suspended (its checkpoint is its state). Whenever a worker is
free it asks ``next_move``: promote the best not-yet-promoted trial of the highest rung whose top 1/η
it is in, else start a new trial at the bottom rung. With a fixed number of trials, once every trial
has started and nothing is promotable or running, the best trial of the highest rung reached goes on
one rung at a time to the last one, so the sweep always ends with a trial trained to the full budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Standing:
    """One trial as the rule sees it.

    ``values[k]`` is the objective at rung k, for each rung reached. ``busy``: a worker trains it
    toward its next rung (it was promoted, or it is new). ``out``: it can never be promoted again
    (finished, failed, or left at its rung when the sweep ended); it still counts in its rungs.
    """

    number: int
    values: tuple[float, ...] = ()
    busy: bool = False
    out: bool = False


@dataclass(frozen=True)
class Promote:
    number: int
    rung: int  # the index of the rung it is to be trained to


@dataclass(frozen=True)
class Start:
    """A new trial at the bottom rung."""


@dataclass(frozen=True)
class Wait:
    """Nothing to do until a running trial reaches its rung."""


@dataclass(frozen=True)
class Done:
    """The budget is spent, nothing is promotable or running, and a trial reached the last rung."""


Move = Promote | Start | Wait | Done


def ranked(trials: Sequence[Standing], rung: int) -> list[Standing]:
    """The trials that reached ``rung``, best first (ties: the earlier trial)."""
    members = [t for t in trials if len(t.values) > rung]
    return sorted(members, key=lambda t: (t.values[rung], t.number))


def promotable(trials: Sequence[Standing], rung: int, eta: int) -> list[Standing]:
    """The rung's top 1/η (rounded down, as the paper's ``top_k``) that have not gone on from it."""
    members = ranked(trials, rung)
    top = members[: len(members) // eta]
    return [t for t in top if len(t.values) == rung + 1 and not t.busy and not t.out]


def next_move(trials: Sequence[Standing], *, num_rungs: int, eta: int, budget: int) -> Move:
    """What a free worker does next, given every trial of the sweep (those running included)."""
    # Highest rung first: a trial nearer the end is worth more than a new one.
    for rung in reversed(range(num_rungs - 1)):
        candidates = promotable(trials, rung, eta)
        if candidates:
            return Promote(candidates[0].number, rung + 1)
    if len(trials) < budget:
        return Start()
    if any(t.busy for t in trials):
        return Wait()  # a running trial may yet make a promotion possible
    reached = [len(t.values) - 1 for t in trials if t.values]
    if not reached:
        return Done()  # every trial failed before its first rung
    highest = max(reached)
    best = [t for t in ranked(trials, highest) if not t.out and not t.busy]
    if highest < num_rungs - 1 and best:
        # The budget's trials are spent and the rule promotes none: the best of the highest rung goes
        # on, one rung at a time, so the sweep's best trial is trained to the full budget.
        return Promote(best[0].number, highest + 1)
    return Done()
