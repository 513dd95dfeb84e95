"""The sweep engine's ASHA scheduling, on a replayed job (milliseconds a launch): the rule alone; a
sweep prunes and promotes by resuming, in the exact order Li et al.'s rule prescribes with one worker
and with two; a sweep killed between a rung and its promotion, or mid-launch, continues without
retraining; workers sharing a sweep keep to its budget and win a suspended trial once; a lease lapses
with time or its process; the plots show the rungs. The spec, the CLI and the real job:
``test_sweep.py``."""

from __future__ import annotations

import heapq
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sweep_helpers import Replay, write_spec

from tasks.pretrain.config import PretrainParams
from tasks.pretrain.result import PretrainResult
from tasks.settings import Settings
from tasks.sweep.engine import Claim, Sweep, lease_expired, summary, sweep_trials
from tasks.sweep.spec import load_spec


def test_a_lease_lapses_with_time_or_with_its_process() -> None:
    import socket

    host = socket.gethostname()
    assert not lease_expired({"owner": f"{host}:{os.getpid()}:x", "until": time.time() + 60})
    assert lease_expired({"owner": f"{host}:{os.getpid()}:x", "until": time.time() - 1})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert lease_expired({"owner": f"{host}:{dead.pid}:x", "until": time.time() + 60})
    assert not lease_expired({"owner": f"elsewhere:{dead.pid}:x", "until": time.time() + 60})


# -- the engine, on a replayed job ------------------------------------------------------------------


class Scripted(Replay):
    """A stand-in whose objective is a table by trial (its settings are its number's) and rung steps:
    the order ASHA promotes in can be worked out by hand."""

    def __init__(self, table: dict[int, dict[int, float]], fail_at: int | None = None) -> None:
        super().__init__(fail_at)
        self.table = table

    def objective(self, params: PretrainParams) -> float:
        assert params.run and params.max_steps
        return self.table[params.max_steps].get(int(params.run.rsplit("-t", 1)[1]), 9.0)


def test_asha_prunes_and_promotes_by_resuming(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    job = Replay()
    result = Sweep(spec, settings, job).run().model_dump()
    assert len(result["trials"]) == 6
    # A promoted trial goes on from where it stopped: every launch starts at the run's last step.
    for run in job.steps:
        starts = [(a, b) for r, a, b in job.launches if r == run]
        assert [a for a, _ in starts] == [0, *[b for _, b in starts[:-1]]]
    for row in result["trials"]:
        assert row["steps"] in spec.rungs()
        assert (row["state"] == "complete") == (row["steps"] == 9)
    assert result["steps_trained"] == sum(b - a for _, a, b in job.launches) < 6 * 9
    assert {r["state"] for r in result["trials"]} == {"complete", "pruned"}
    best = min((r for r in result["trials"] if r["state"] == "complete"), key=lambda r: r["value"])
    assert result["best"]["trial"] == best["trial"]


def test_the_rule_alone() -> None:
    """ASHA's rule as a function: the highest rung's candidate first, a rung's top 1/η rounded down,
    a trial that went on (or trains) not promoted again, then new trials, then waiting, then the best
    of the highest rung to the end."""
    from tasks.sweep.asha import Done, Promote, Standing, Start, Wait, next_move

    def move(*trials: Standing, budget: int = 9) -> object:
        return next_move(trials, num_rungs=3, eta=3, budget=budget)

    rung_0 = [Standing(0, (5.0,)), Standing(1, (4.0,)), Standing(2, (6.0,))]
    assert move(*rung_0) == Promote(1, 1)  # top third of three: trial 1
    assert move(*rung_0[:2]) == Start()  # two: no top third yet
    assert move(*rung_0[:2], Standing(2, busy=True)) == Start()  # trial 2 not at its first rung yet
    went_on = [rung_0[0], Standing(1, (4.0, 3.0)), rung_0[2]]
    assert move(*went_on) == Start()  # trial 1 went on from rung 0
    # Six at rung 0 (top two: 3 and 5) and three at rung 1 (top: 3): the highest rung goes first.
    both = [*went_on, Standing(3, (3.5, 2.0)), Standing(4, (3.8, 2.5)), Standing(5, (3.6,))]
    assert move(*both) == Promote(3, 2)
    assert move(*both[:3], Standing(3, (3.5, 2.0, 1.0)), *both[4:]) == Promote(5, 1)
    # The budget spent: wait while a trial trains; then the best of the highest rung goes on.
    assert move(*rung_0, budget=3) == Promote(1, 1)
    assert move(*went_on[:2], Standing(2, (6.0,), busy=True), budget=3) == Wait()
    assert move(*went_on, budget=3) == Promote(1, 2)
    assert move(*rung_0[:2], Standing(2, (3.0, 5.0, 4.0), out=True), budget=3) == Done()


# The objective by rung steps (1, 3, 9) and trial. At the first rung trial 4 is the best; at the second,
# trial 3. Worked by hand from ASHA's rule (promote the best not-yet-promoted trial of the highest rung
# whose top 1/3 it is in, else start a trial; with the budget spent, the best of the highest rung goes on).
TABLE = {1: {0: 5.0, 1: 4.0, 2: 6.0, 3: 3.0, 4: 2.0, 5: 7.0}, 3: {1: 3.5, 3: 2.0, 4: 2.8}, 9: {3: 1.5}}
ONE_WORKER = [
    (0, 0, 1), (1, 0, 1), (2, 0, 1),  # three at rung 1: trial 1 is its top third
    (1, 1, 3),
    (3, 0, 1),  # four at rung 1: trial 3 is the top one, not yet promoted
    (3, 1, 3),
    (4, 0, 1),  # five: trial 4 the top one
    (4, 1, 3),  # three at rung 3: trial 3 the top one, and the highest rung goes first
    (3, 3, 9),
    (5, 0, 1),  # the last trial of the budget; then nothing is promotable
]  # fmt: skip
# Two workers, a launch taking as long as the steps it trains (ties: the first worker first).
TWO_WORKERS = [
    (0, 0, 1), (1, 0, 1),  # time 0
    (2, 0, 1), (3, 0, 1),  # time 1: one and two at rung 1, no top third yet
    (1, 1, 3), (3, 1, 3),  # time 2: trial 1 tops three, then trial 3 tops four
    (4, 0, 1), (5, 0, 1),  # time 4: rung 3 holds two, no top third; the budget's last trials
    (4, 1, 3),  # time 5: trial 4 tops six at rung 1 (trial 5 done at 5 too, its worker waits)
    (3, 3, 9),  # time 7: trial 3 tops three at rung 3
]  # fmt: skip


def test_asha_promotes_in_the_order_its_rule_prescribes_with_one_worker(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    job = Scripted(TABLE)
    result = Sweep(spec, Settings(home=tmp_path / "home"), job).run().model_dump()
    assert job.order() == ONE_WORKER
    rows = {r["trial"]: (r["state"], r["rung"], r["steps"]) for r in result["trials"]}
    assert rows == {
        0: ("pruned", 1, 1), 1: ("pruned", 2, 3), 2: ("pruned", 1, 1),
        3: ("complete", 3, 9), 4: ("pruned", 2, 3), 5: ("pruned", 1, 1),
    }  # fmt: skip
    assert result["best"]["trial"] == 3 and result["best"]["value"] == 1.5
    # Steps trained are each trial's final rung summed: no step trained twice.
    assert result["steps_trained"] == sum(r["steps"] for r in result["trials"]) == 6 * 1 + 3 * 2 + 6


def test_with_the_budget_spent_the_best_of_the_highest_rung_goes_to_the_end(tmp_path: Path) -> None:
    """Trial 4 no longer tops rung 1: rung 3 holds two trials, too few for a top third, so trial 3
    (the better of the two there) is taken to the last rung once every trial has its first."""
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    job = Scripted({**TABLE, 1: {**TABLE[1], 4: 4.5}})
    result = Sweep(spec, Settings(home=tmp_path / "home"), job).run().model_dump()
    assert job.order() == [*ONE_WORKER[:7], (5, 0, 1), (3, 3, 9)]
    assert [r["state"] for r in result["trials"]].count("complete") == 1
    assert result["steps_trained"] == sum(r["steps"] for r in result["trials"]) == 16


def simulate(
    sweep: Sweep, workers: int
) -> tuple[list[tuple[int, int, int]], list[dict[int, tuple[str, int]]]]:
    """The sweep's own claim and train on a virtual clock: a launch takes as long as the steps it
    trains, and it is trained (the job called) when it ends. The claims in order, and the trial table
    (state, rung) after each launch's end and the claims that follow it."""
    storage = sweep.study._storage
    claims, tables = [], []
    running: list[tuple[int, int, Claim]] = []  # (ends at, worker, claim)
    free, clock = list(range(workers)), 0
    while True:
        while free:
            claim = sweep.claim()
            if not isinstance(claim, Claim):
                break  # Wait, or Done
            start = int(storage.get_trial(claim.trial_id).user_attrs["steps"])
            claims.append((claim.number, start, claim.target))
            heapq.heappush(running, (clock + claim.target - start, free.pop(0), claim))
        tables.append({r.trial: (r.state, r.rung) for r in summary(sweep.study).trials})
        if not running:
            return claims, tables
        clock, worker, claim = heapq.heappop(running)
        sweep.train(claim)
        free = sorted([*free, worker])


def test_asha_promotes_in_the_order_its_rule_prescribes_with_two_workers(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    job = Scripted(TABLE)
    sweep = Sweep(spec, Settings(home=tmp_path / "home"), job)
    claims, tables = simulate(sweep, workers=2)
    assert claims == TWO_WORKERS
    # `sweep status` on the way: trial 4 promoted (training to rung 2) while 5 waits at rung 1.
    assert tables[8] == {
        0: ("suspended", 1), 1: ("suspended", 2), 2: ("suspended", 1),
        3: ("suspended", 2), 4: ("promoted", 1), 5: ("suspended", 1),
    }  # fmt: skip
    assert tables[6][5] == ("running", 0)
    result = summary(sweep.study).model_dump()
    assert {r["trial"]: r["state"] for r in result["trials"]} == {
        0: "pruned",
        1: "pruned",
        2: "pruned",
        3: "complete",
        4: "pruned",
        5: "pruned",
    }
    assert result["steps_trained"] == sum(r["steps"] for r in result["trials"]) == 18
    for run in job.steps:  # each launch went on from the run's last step
        starts = [(a, b) for r, a, b in job.launches if r == run]
        assert [a for a, _ in starts] == [0, *[b for _, b in starts[:-1]]]


def test_only_one_worker_wins_a_suspended_trial(tmp_path: Path) -> None:
    """Four workers (each with its own study object, as four processes) try to promote each of 30
    suspended trials at once: each trial is won exactly once, on SQLite too."""
    from optuna.trial import TrialState

    from tasks.sweep.engine import take_waiting

    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    settings = Settings(home=tmp_path / "home")
    studies = [Sweep(spec, settings, Replay()).study for _ in range(4)]
    storage = studies[0]._storage
    ids = [storage.create_new_trial(studies[0]._study_id) for _ in range(30)]
    for trial_id in ids:
        storage.set_trial_state_values(trial_id, TrialState.WAITING)
    start = threading.Barrier(4)

    def promote_all(study: Any) -> list[int]:
        start.wait()
        return [trial_id for trial_id in ids if take_waiting(study, trial_id)]

    with ThreadPoolExecutor(4) as pool:
        won = [trial_id for wins in pool.map(promote_all, studies) for trial_id in wins]
    assert sorted(won) == ids


class Killed(Exception):
    """The sweep's process dies (a SIGKILL, as far as the storage can tell)."""


@pytest.mark.parametrize("when", ["after a rung", "in a promotion"])
def test_a_sweep_killed_between_a_rung_and_its_promotion_resumes_without_retraining(
    when: str, tmp_path: Path
) -> None:
    """Trial 2 reaches rung 1, which makes trial 1 promotable: the sweep dies right after trial 2's
    rung is recorded, or inside trial 1's promoted launch before it trains. The rerun promotes (or
    takes over) trial 1 from its checkpoint at step 1 and launches what a straight sweep does."""
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    settings = Settings(home=tmp_path / "home", sweep_lease_seconds=0.2)
    job = Scripted(TABLE, fail_at=3 if when == "in a promotion" else None)

    def die_after_third_rung(trial: int, run_id: str | None, rung: int, value: float, state: str) -> None:
        if len(job.launches) == 3:
            raise Killed

    with pytest.raises((Killed, KeyboardInterrupt)):
        Sweep(spec, settings, job, on_rung=die_after_third_rung if when == "after a rung" else None).run()
    assert job.order() == ONE_WORKER[:3]
    states = {r.trial: r.state for r in summary(Sweep(spec, settings, job).study).trials}
    assert states == ({0: "suspended", 1: "suspended", 2: "suspended"} if when == "after a rung" else
                      {0: "suspended", 1: "promoted", 2: "suspended"})  # fmt: skip
    time.sleep(0.3)  # a dead worker's lease lapses
    job.fail_at = None
    result = Sweep(spec, settings, job).run().model_dump()
    assert job.order() == ONE_WORKER  # (1, 1, 3): trial 1 resumed at step 1, nothing launched twice
    assert result["steps_trained"] == sum(r["steps"] for r in result["trials"]) == 18


def test_the_plots_show_the_rungs(tmp_path: Path) -> None:
    """The parent run's plots: a dotted line and a tick at each rung, each trial coloured by its rung."""
    from tasks.sweep.tracking import objective_by_step, objective_by_trial

    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    sweep = Sweep(spec, Settings(home=tmp_path / "home"), Scripted(TABLE))
    result = sweep.run()
    from tasks.sweep.engine import rung_history

    by_step = objective_by_step(rung_history(sweep.study), spec.rungs())
    (axes,) = by_step.axes
    assert list(axes.get_xticks()) == [1, 3, 9]
    assert sorted(line.get_xdata()[0] for line in axes.lines if line.get_linestyle() == ":") == [1, 3, 9]
    by_trial = objective_by_trial([row.model_dump() for row in result.trials], spec.rungs())
    labels = [text.get_text() for text in by_trial.axes[0].get_legend().get_texts()]
    assert labels == ["rung 1 (1 steps)", "rung 2 (3 steps)", "rung 3 (9 steps)"]


def test_a_killed_sweep_continues_where_it_stopped(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    uninterrupted = Replay()
    straight = Sweep(spec, Settings(home=tmp_path / "a"), uninterrupted).run().model_dump()

    settings = Settings(home=tmp_path / "b", sweep_lease_seconds=0.2)
    job = Replay(fail_at=2)  # trial 0 dies going to its last rung, two rungs promoted
    with pytest.raises(KeyboardInterrupt):
        Sweep(spec, settings, job).run()
    time.sleep(0.3)  # the dead worker's lease lapses
    job.fail_at = None
    again = Sweep(spec, settings, job).run().model_dump()
    assert [(r["trial"], r["state"], r["steps"]) for r in again["trials"]] == [
        (r["trial"], r["state"], r["steps"]) for r in straight["trials"]
    ]
    # No rung trained twice, nor launched again: the continued sweep made the launches a straight one did.
    assert len(set(job.launches)) == len(job.launches)
    assert sorted(job.launches) == sorted(uninterrupted.launches)
    assert again["steps_trained"] == straight["steps_trained"]


@pytest.mark.slow
def test_several_workers_share_one_sweep(tmp_path: Path) -> None:
    """Two workers (as two processes would: their own study objects and leases) with two threads each
    run one sweep at once: the budget's trials exactly, each drawn once with the settings a lone worker
    draws for its number, no rung launched twice, and trials really trained side by side."""
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json"))
    alone = Sweep(spec, Settings(home=tmp_path / "alone"), Replay()).run().model_dump()

    settings = Settings(home=tmp_path / "shared")
    job, running, most = Replay(), [0], [0]
    lock = threading.Lock()

    def slow(params: PretrainParams) -> PretrainResult:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        try:
            return job(params)
        finally:
            with lock:
                running[0] -= 1

    workers = [Sweep(spec, settings, slow, poll_seconds=0.05) for _ in range(2)]
    start = threading.Barrier(2)

    def work(sweep: Sweep) -> dict[str, Any]:
        start.wait()
        return sweep.run(parallel=2).model_dump()

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(work, workers))
    shared = results[0]
    assert results[1]["trials"] == shared["trials"]
    assert [r["trial"] for r in shared["trials"]] == list(range(6))
    assert {r["state"] for r in shared["trials"]} <= {"complete", "pruned"}
    study = workers[0].study
    drawn = {t.number: t.user_attrs["values"] for t in sweep_trials(study)}
    assert drawn == {
        t.number: t.user_attrs["values"]
        for t in sweep_trials(Sweep(spec, Settings(home=tmp_path / "alone"), job).study)
    }
    assert len({v["lr"] for v in drawn.values()}) == 6
    assert len(set(job.launches)) == len(job.launches)  # no rung launched twice
    for run in job.steps:  # each trial's launches go on from where the last one stopped
        starts = [(a, b) for r, a, b in job.launches if r == run]
        assert [a for a, _ in starts] == [0, *[b for _, b in starts[:-1]]]
    assert shared["steps_trained"] == sum(b - a for _, a, b in job.launches)
    assert most[0] >= 2  # trials trained at once
    assert len(alone["trials"]) == 6


def test_workers_that_ask_at_once_keep_to_the_budget(tmp_path: Path) -> None:
    """Four workers start a two-trial sweep in the same instant: the ones that ask past the budget
    train nothing, and the sweep holds two trials."""
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json", trials=2))
    settings = Settings(home=tmp_path / "home")
    job = Replay()
    workers = [Sweep(spec, settings, job, poll_seconds=0.05) for _ in range(4)]
    start = threading.Barrier(4)

    def work(sweep: Sweep) -> dict[str, Any]:
        start.wait()
        return sweep.run().model_dump()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, workers))
    assert [[r["trial"] for r in result["trials"]] for result in results] == [[0, 1]] * 4
    assert {run for run, _, _ in job.launches} == {r["run"] for r in results[0]["trials"]}
    asked = workers[0].study.get_trials(deepcopy=False)
    assert all(t.user_attrs.get("surplus") for t in asked if t.number >= 2)
