"""Sweeps: a bad spec is one error naming the key before any trial; ASHA promotes in the order Li et
al.'s rule prescribes and a promoted trial resumes its run; a killed sweep continues without redoing a
finished rung; Optuna, MLflow and the JSON agree."""

from __future__ import annotations

import heapq
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tasks.corpus.sample import write_labelled_sample
from tasks.pretrain.config import PretrainParams
from tasks.pretrain.result import PretrainResult
from tasks.settings import Settings
from tasks.sweep.engine import Claim, Sweep, lease_expired, summary, sweep_trials
from tasks.sweep.spec import SpecError, load_spec, parse_spec

CLI = str(Path(sys.executable).parent / "mlstm-sentiment")

SPEC = """\
corpus: {corpus}
preset: tiny
seq_len: 32
log_every: 1
objective: val_bpc
budget: {{trials: {trials}, max_steps: {max_steps}}}
asha: {{min_steps: 1, eta: 3}}   # rungs at 1, 3, 9, … steps up to max_steps
sampler: random
seed: {seed}
space:
  lr: {{log_uniform: [1.0e-4, 3.0e-2]}}
  batch_size: {{choice: [8, 16]}}
"""


def write_spec(
    path: Path, corpus: str = "newest", *, trials: int = 6, seed: int = 0, max_steps: int = 9, extra: str = ""
) -> Path:
    path.write_text(SPEC.format(corpus=corpus, trials=trials, seed=seed, max_steps=max_steps) + extra)
    return path


# -- the spec ---------------------------------------------------------------------------------------

BAD_SPECS = {
    # name: (what to change in the good spec, the key and line the error must name)
    "unknown key": ("colour: blue\n", "colour", 13),
    "unknown parameter": ("  dropout: {uniform: [0.0, 0.5]}\n", "space.dropout", 13),
    "empty range": ("  warmup_steps: {int_uniform: [5, 2]}\n", "space.warmup_steps.int_uniform", 13),
    "empty real range": ("  warmup_steps: {uniform: [3.0, 3.0]}\n", "space.warmup_steps.uniform", 13),
    "log range from zero": (
        "  warmup_steps: {log_uniform: [0.0, 10.0]}\n",
        "space.warmup_steps.log_uniform",
        13,
    ),
    "empty choice": ("  seq_len: {choice: []}\n", "space.seq_len.choice", 13),
    "unknown distribution": ("  warmup_steps: {normal: [0, 1]}\n", "space.warmup_steps", 13),
    "budget below one rung": ("", "budget.max_steps", 6),
    "batch the ranks cannot split": ("nproc: 3\n", "space.batch_size", 12),
    "unknown nested key": ("", "asha.rate", 7),
    "a fixed setting the sweep owns": ("max_steps: 5\n", "max_steps", 13),
    "a grid smaller than the budget": ("", "budget.trials", 6),
    # Every trial would fail minutes in (torch: "value cannot be converted to type float without overflow").
    "a range beyond float32": ("", "space.lr", 11),
}


@pytest.mark.parametrize("case", BAD_SPECS)
def test_a_bad_spec_is_one_error_naming_the_key_and_line(case: str, tmp_path: Path) -> None:
    extra, key, line = BAD_SPECS[case]
    path = write_spec(tmp_path / "spec.yaml", extra=extra)
    if case == "budget below one rung":
        path.write_text(path.read_text().replace("min_steps: 1", "min_steps: 10"))
    if case == "unknown nested key":
        path.write_text(path.read_text().replace("eta: 3", "rate: 3"))
    if case == "a range beyond float32":
        path.write_text(
            path.read_text().replace("log_uniform: [1.0e-4, 3.0e-2]", "log_uniform: [1.0e-4, 1.0e308]")
        )
    if case == "a grid smaller than the budget":  # 2 × 2 points for 6 trials
        text = path.read_text().replace("sampler: random", "sampler: grid")
        path.write_text(text.replace("log_uniform: [1.0e-4, 3.0e-2]", "choice: [1.0e-3, 1.0e-2]"))
    with pytest.raises(SpecError) as raised:
        load_spec(path)
    assert str(raised.value).startswith(f"{path}:{line}: {key}: "), str(raised.value)
    if case == "a grid smaller than the budget":
        assert (
            str(raised.value)
            == f"{path}:6: budget.trials: 6 trials but the grid has 4 points: ask for at most 4"
        )


# name: (a replacement in the good spec, the message's start after the file and line)
EXPLODING_SPECS = {
    "a range of batches with several ranks": (
        ("batch_size: {choice: [8, 16]}", "batch_size: {int_uniform: [8, 100000000000]}\nnproc: 2"),
        "space.batch_size: a range of batches holds some that do not split among 2 ranks",
    ),
    "a choice the settings refuse": (
        ("batch_size: {choice: [8, 16]}", "batch_size: {choice: [0, -8]}"),
        "space.batch_size: 0: Input should be greater than or equal to 1",
    ),
    "an infinite range": (("3.0e-2]", ".inf]"), "space.lr.log_uniform: log_uniform needs finite ends"),
    "a trillion trials": (("trials: 6", "trials: 1000000000000"), "budget.trials: Input should be less than"),
}


@pytest.mark.parametrize("case", EXPLODING_SPECS)
def test_a_spec_whose_numbers_explode_is_refused_by_key(case: str, tmp_path: Path) -> None:
    """Ranges are checked by their ends, never enumerated; every value must be one the settings take."""
    (old, new), message = EXPLODING_SPECS[case]
    path = write_spec(tmp_path / "spec.yaml")
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(SpecError) as raised:
        load_spec(path)
    assert str(raised.value).split(": ", 1)[1].startswith(message), str(raised.value)


def test_yaml_aliases_are_refused_before_they_expand(tmp_path: Path) -> None:
    """Nine lines of anchors make a billion keys (a 'billion laughs'), which walking the file for key lines
    would visit one by one; the spec is refused before."""
    level = ", ".join(f"k{j}: 1" for j in range(10))
    bomb = f"l0: &l0 {{{level}}}\n" + "".join(
        f"l{i}: &l{i} {{{', '.join(f'k{j}: *l{i - 1}' for j in range(10))}}}\n" for i in range(1, 9)
    )
    path = write_spec(tmp_path / "spec.yaml", extra=bomb)
    with pytest.raises(SpecError, match=r"YAML aliases \(\*name\) are not taken"):
        load_spec(path)


def test_the_cli_refuses_a_bad_spec_before_any_trial(tmp_path: Path, home: Path) -> None:
    path = write_spec(tmp_path / "spec.yaml", extra="nproc: 3\n")
    done = subprocess.run([CLI, "sweep", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {path}:12: space.batch_size: a batch of 8 rows does not split among 3 ranks"
    ]
    assert not (home / "optuna.db").exists() and not (home / "store" / "runs").exists()


def test_rungs_and_the_sweep_id() -> None:
    base: dict[str, Any] = {
        "corpus": "/c/manifest.json",
        "preset": "tiny",
        "budget": {"trials": 6, "max_steps": 90},
        "asha": {"min_steps": 10, "eta": 3},
        "space": {"lr": {"log_uniform": [1e-4, 1e-2]}},
    }
    spec = parse_spec(base)
    assert spec.rungs() == [10, 30, 90]
    assert parse_spec({**base, "budget": {"trials": 6, "max_steps": 50}}).rungs() == [10, 30, 50]
    assert parse_spec(dict(base)).sweep_id() == spec.sweep_id()  # the same spec is the same sweep
    assert parse_spec({**base, "seed": 1}).sweep_id() != spec.sweep_id()
    launch = spec.trial_params({"lr": 0.001}, "r", 30)
    assert (launch.max_steps, launch.total_steps, launch.run, launch.lr) == (30, 90, "r", 0.001)


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


class Replay:
    """A stand-in job whose val_bpc is a fixed function of lr and steps, and whose runs keep their
    step like checkpoints do: enough to check the rung logic and the bookkeeping in milliseconds.
    (The slow tests below run the real job.)"""

    def __init__(self, fail_at: int | None = None) -> None:
        self.steps: dict[str, int] = {}
        self.launches: list[tuple[str, int, int]] = []  # (run, from step, to step)
        self.fail_at = fail_at

    def __call__(self, params: PretrainParams) -> PretrainResult:
        if self.fail_at is not None and len(self.launches) == self.fail_at:
            raise KeyboardInterrupt  # the worker dies mid-sweep, telling Optuna nothing
        assert params.run and params.max_steps
        start = self.steps.get(params.run, 0)
        self.launches.append((params.run, start, params.max_steps))
        self.steps[params.run] = max(start, params.max_steps)
        value = self.objective(params)
        return PretrainResult(
            run=params.run, run_id=None, checkpoint_uri="x", steps=self.steps[params.run],
            total_steps=params.total_steps or params.max_steps, final_loss=value, val_bpc=value,
        )  # fmt: skip

    def objective(self, params: PretrainParams) -> float:
        return 8 - math.log10(params.lr) * 0.1 * math.log1p(params.max_steps)  # higher lr, lower bpc

    def order(self) -> list[tuple[int, int, int]]:
        """The launches as (trial number, from step, to step)."""
        return [(int(run.rsplit("-t", 1)[1]), a, b) for run, a, b in self.launches]


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


@pytest.mark.slow
def test_sweep_status_reads_the_storage(tmp_path: Path, home: Path) -> None:
    """`sweep status` lists the sweeps in Optuna's storage and prints one sweep's JSON, as `sweep --json` does."""
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json", trials=3))
    result = Sweep(spec, Settings(home=home), Replay()).run().shown()
    listed = subprocess.run([CLI, "sweep", "status", "--json"], capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-3000:]
    (row,) = json.loads(listed.stdout)
    states = sorted(r["state"] for r in result["trials"])
    assert (row["sweep_id"], row["trials"]) == (spec.sweep_id(), 3)
    assert row["states"] == ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))
    assert row["best"] == result["best"]["value"]
    one = subprocess.run(
        [CLI, "sweep", "status", spec.sweep_id(), "--json"], capture_output=True, text=True, timeout=300
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert json.loads(one.stdout) == result
    unknown = subprocess.run(
        [CLI, "sweep", "status", "sweep-nope"], capture_output=True, text=True, timeout=300
    )
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "no sweep 'sweep-nope'" in unknown.stderr and spec.sweep_id() in unknown.stderr


# -- the real job -----------------------------------------------------------------------------------


def sweep_json(spec: Path, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [CLI, "sweep", str(spec), "--json", *extra], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def job_processes(home: Path) -> list[int]:
    """Processes running with this test's MLSTM_HOME: the training jobs it started."""
    marker = f"MLSTM_HOME={home.resolve()}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def loss_steps(client: Any, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


@pytest.mark.long
@pytest.mark.timeout(2400)  # about a dozen launches of torchrun on two shared cores
def test_an_asha_sweep_of_the_real_job_on_the_shared_corpus(
    amazon_manifest: str, home: Path, tmp_path: Path, prefect_api_url: str
) -> None:
    import mlflow
    import optuna
    from mlflow.tracking import MlflowClient

    from tasks.jobs.checkpoint import read_latest
    from tasks.store import LocalStore

    # Rungs at 1 and 3 steps: the fewest launches that still promote, prune and resume.
    spec = write_spec(tmp_path / "spec.yaml", amazon_manifest, max_steps=3)
    result = sweep_json(spec)
    rungs = [1, 3]
    trials = result["trials"]
    assert len(trials) == 6 and {t["state"] for t in trials} <= {"complete", "pruned"}
    # ASHA spends fewer steps than the same trials run to completion, and trains each step once.
    assert result["steps_trained"] == sum(t["steps"] for t in trials) < 6 * 3
    for trial in trials:
        assert trial["steps"] == 3 if trial["state"] == "complete" else trial["steps"] in rungs[:-1]

    # The Prefect flow run carries the trial table as an artifact.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as prefect:
        tables = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sweep-trials"]))
        )
    assert trials in [json.loads(t.data) if isinstance(t.data, str) else t.data for t in tables]

    # Optuna's storage, MLflow's child runs and the JSON agree on the trials and their states.
    study = optuna.load_study(study_name=result["sweep_id"], storage=f"sqlite:///{home / 'optuna.db'}")
    assert [(t.number, t.state.name.lower()) for t in study.trials] == [
        (t["trial"], t["state"]) for t in trials
    ]
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    client = MlflowClient()
    parent = client.search_runs(
        [client.get_experiment_by_name("mlstm-sentiment").experiment_id],
        f"tags.sweep_id = '{result['sweep_id']}' and tags.stage = 'sweep'",
    )[0]
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_trial = {int(c.data.tags["sweep_trial"]): c for c in children}
    assert len(children) == 6 and sorted(by_trial) == [t["trial"] for t in trials]
    for trial in trials:
        child = by_trial[trial["trial"]]
        assert child.data.tags["sweep_state"] == trial["state"]
        # Promoted trials resumed: the loss was logged once per step, never again from step 1.
        steps = loss_steps(client, child.info.run_id)
        assert steps == list(range(1, trial["steps"] + 1))
        objective = client.get_metric_history(child.info.run_id, "objective")
        assert sorted(m.step for m in objective) == [r for r in rungs if r <= trial["steps"]]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"objective_by_trial.png", "objective_by_step.png", "parallel_coordinates.png"} <= artifacts
    best = result["best"]
    assert by_trial[best["trial"]].data.tags["sweep_best"] == "true"
    assert parent.data.tags["best_checkpoint_uri"] == best["checkpoint_uri"]

    # The best trial, trained in three launches, ends where one straight run of its settings does.
    store = LocalStore(home / "store")
    sweep_loss = read_latest(store, best["run"])["loss"]  # type: ignore[index]
    straight = subprocess.run(
        [
            CLI, "pretrain", "--corpus", amazon_manifest, "--preset", "tiny", "--seq-len", "32",
            "--batch-size", str(best["params"]["batch_size"]), "--lr", repr(best["params"]["lr"]),
            "--max-steps", "3", "--total-steps", "3", "--run", "straight", "--json",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert json.loads(straight.stdout)["final_loss"] == pytest.approx(sweep_loss, abs=1e-6)

    # The pipeline takes its pretraining from the sweep: the best checkpoint, the sweep in the lineage.
    labelled = write_labelled_sample(tmp_path / "labelled", num_reviews=300)
    done = subprocess.run(
        [CLI, "pipeline", "--from-sweep", result["sweep_id"], "--dataset", f"reviews={labelled}", "--json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    registered = json.loads(done.stdout)["transfer"]["registered"]
    tags = client.get_model_version(registered["name"], str(registered["version"])).tags
    assert tags["sweep_id"] == result["sweep_id"] and tags["checkpoint_uri"] == best["checkpoint_uri"]
    assert tags["pretrain_run_id"] == best["run_id"] and tags["sweep_trial"] == str(best["trial"])


# Each trial's objective at each rung it reached, from Optuna's storage.
RUNGS_REACHED = (
    "select t.number || ':' || v.step, v.intermediate_value from trial_intermediate_values v "
    "join trials t using (trial_id)"
)


@pytest.mark.long
@pytest.mark.timeout(2400)
def test_a_sweep_killed_half_way_finishes_without_redoing_a_rung(
    amazon_manifest: str, home: Path, tmp_path: Path, prefect_api_url: str
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    spec = write_spec(tmp_path / "spec.yaml", amazon_manifest, trials=3, seed=1, max_steps=3)
    first = subprocess.Popen(
        [CLI, "sweep", str(spec), "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    database = home / "optuna.db"
    decided = 0
    deadline = time.monotonic() + 900
    while decided < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
        if database.exists():
            with sqlite3.connect(database) as db:
                decided = db.execute("select count(*) from trial_intermediate_values").fetchone()[0]
    assert first.poll() is None, "the sweep ended before it could be killed half-way"
    os.kill(first.pid, signal.SIGKILL)  # the sweep, with no chance to clean up
    first.wait()
    # Its training job gets SIGTERM from the kernel (the launcher's parent-death signal) and checkpoints.
    while job_processes(home):
        time.sleep(0.5)
    with sqlite3.connect(database) as db:
        before = dict(db.execute(RUNGS_REACHED).fetchall())

    result = sweep_json(spec)
    assert len(result["trials"]) == 3 and {t["state"] for t in result["trials"]} <= {"complete", "pruned"}
    with sqlite3.connect(database) as db:
        after = dict(db.execute(RUNGS_REACHED).fetchall())
    assert before.items() <= after.items()  # rungs reached before the kill stand, with their objective
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    client = MlflowClient()
    runs = client.search_runs(
        [client.get_experiment_by_name("mlstm-sentiment").experiment_id],
        f"tags.sweep_id = '{result['sweep_id']}' and tags.stage = 'pretrain'",
    )
    assert len(runs) == 3
    for run in runs:
        steps = loss_steps(client, run.info.run_id)
        assert len(steps) == len(set(steps)), f"{run.data.tags['run']} trained a step twice: {steps}"


def test_the_pipeline_takes_a_sweep_instead_of_pretraining() -> None:
    from tasks.pipeline import PipelineParams

    params = PipelineParams(stages=["transfer"], from_sweep="sweep-x", transfer={"datasets": ["a=b"]})
    assert params.checkpoint_uri is None  # the flow takes the sweep's best checkpoint
    with pytest.raises(ValueError, match="from_sweep: the sweep's best trial is the pretraining"):
        PipelineParams(
            stages=["pretrain", "transfer"], from_sweep="s", manifest_uri="m", transfer={"datasets": ["a=b"]}
        )
    with pytest.raises(ValueError, match="checkpoint_uri: transfer without the pretraining stage"):
        PipelineParams(stages=["transfer"], transfer={"datasets": ["a=b"]})


def test_from_sweep_names_a_sweep_that_exists(tmp_path: Path) -> None:
    from tasks.sweep.engine import best_trial

    settings = Settings(home=tmp_path / "home")
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json", trials=1))
    Sweep(spec, settings, Replay()).run()
    assert best_trial(spec.sweep_id(), settings).manifest_uri == "/c/manifest.json"
    with pytest.raises(ValueError, match=f"no sweep 'sweep-nope' in .*sweeps there: {spec.sweep_id()}"):
        best_trial("sweep-nope", settings)


def test_the_sweep_deployment_holds_a_valid_spec() -> None:
    import yaml

    from tasks.sweep.spec import SweepSpec

    infra = Path(__file__).resolve().parents[1] / "infra" / "prefect.yaml"
    deployments = yaml.safe_load(infra.read_text())["deployments"]
    (deployment,) = [d for d in deployments if d["entrypoint"] == "flows/sweep.py:sweep"]
    spec = SweepSpec(**deployment["parameters"]["spec"])
    assert spec.rungs() == [1000, 3000, 9000, 27000] and spec.fixed["preset"] == "paper_4096"
    assert deployment["work_pool"]["name"] == "gpu"
