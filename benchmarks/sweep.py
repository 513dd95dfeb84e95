"""ASHA against random search and against Optuna's pruner, over the same trials: training steps
spent, wall time and the best val_bpc each reaches, with one worker and with two.

For each seed and each number of workers, three arms search the pretraining job (tiny preset, the
shared Amazon corpus) over the same trials (the same sampler, seed and trial numbers draw the same
settings):

- **ASHA**: ``tasks.sweep.engine.Sweep``, the stage's own engine: trials suspend at each rung and a
  free worker promotes by Li et al.'s rule, resuming the trial's run.
- **random search**: every trial trained straight to ``max_steps``.
- **Optuna pruner**: the stage before ASHA: each trial runs rung after rung, asking Optuna's
  ``SuccessiveHalvingPruner`` at each rung whether to stop (a copy of that engine's loop, here).

Each launch runs the job's own ``fit`` (one rank) in a pool of worker processes, one per sweep worker,
started before the clock: the same training as under torchrun, without a torchrun start per launch,
which on two cores costs more than the tiny model's steps.

    .venv/bin/python benchmarks/sweep.py                       # 3 seeds × 6 trials, rungs 3, 9, 27; 1 and 2 workers
    .venv/bin/python benchmarks/sweep.py --seeds 1 --workers 1 --max-steps 9 --min-steps 1    # a quick look
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import REPO, add_record_option, describe, machine, new_parser, record, say

sys.path.insert(0, str(REPO / "tests"))


def build_corpus(root: Path, data: Path) -> str:
    from corpus_helpers import build

    from tasks.corpus.build import CorpusConfig

    files = sorted((data / "amazon").glob("*.gz"))
    if not files:
        raise SystemExit(f"no Amazon files in {data / 'amazon'}: pass --data with the shared data folder")
    manifest = build(files, root / "store", CorpusConfig(split=(98, 1, 1)))
    return str(root / "store" / "corpora" / manifest.corpus_id / "manifest.json")


def _threads(count: int) -> None:
    """A pool process's torch threads: the machine's cores shared among the sweep's workers."""
    import torch

    torch.set_num_threads(count)


def _fit(params: Any, settings: Any) -> Any:
    """One launch, in a pool process: the job's ``fit`` on one rank, its log kept off the terminal."""
    from tasks.jobs.world import World
    from tasks.pretrain.stage import plan_job
    from tasks.pretrain.train import fit

    # MLflow left out: the arms' training is what is measured, and SQLite is one writer at a time.
    config = plan_job(params, settings).config.model_copy(update={"tracking": "off"})
    with contextlib.redirect_stdout(io.StringIO()):
        return fit(config, World(), settings)


class Launcher:
    """Launches on a pool of ``workers`` processes, counting the steps each run really trains."""

    def __init__(self, workers: int) -> None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        context = multiprocessing.get_context("spawn")
        threads = max(1, cores // workers)
        self.pool = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_threads, initargs=(threads,)
        )
        for future in [self.pool.submit(_threads, threads) for _ in range(workers)]:
            future.result()  # the processes started (torch imported) before any clock
        self.settings: Any = None
        self.steps = 0
        self.trained: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, params: Any) -> Any:
        """The launch's ``PretrainResult`` (the job's ``FitResult``)."""
        result = self.pool.submit(_fit, params, self.settings).result()
        with self.lock:
            self.steps += result.steps - self.trained.get(params.run, 0)
            self.trained[params.run] = result.steps
        return result

    def arm(self, settings: Any) -> Launcher:
        """Start counting afresh for an arm that keeps its runs under ``settings``' store."""
        self.settings, self.steps, self.trained = settings, 0, {}
        return self

    def close(self) -> None:
        self.pool.shutdown()


def spec_for(seed: int, args: Any, corpus: str) -> Any:
    from tasks.sweep.spec import parse_spec

    return parse_spec(
        {
            "corpus": corpus, "preset": "tiny", "seq_len": args.seq_len, "log_every": 1000,
            "budget": {"trials": args.trials, "max_steps": args.max_steps},
            "asha": {"min_steps": args.min_steps, "eta": args.eta},
            "sampler": "random", "seed": seed,
            "space": {"lr": {"log_uniform": [1e-4, 3e-2]}, "batch_size": {"choice": [16, 32]}},
        }
    )  # fmt: skip


def settings_for(home: Path) -> Any:
    from tasks.settings import Settings

    return Settings(home=home, store_uri=str(home / "store"))


def asha(spec: Any, launch: Launcher, workers: int, home: Path) -> dict[str, Any]:
    from tasks.sweep.engine import Sweep

    settings = settings_for(home)
    sweep = Sweep(spec, settings, launch.arm(settings), poll_seconds=0.2)
    started = time.perf_counter()
    result = sweep.run(parallel=workers)
    seconds = time.perf_counter() - started
    assert result.steps_trained == launch.steps == sum(r.steps for r in result.trials)
    assert result.best is not None, "no trial of the arm completed"
    drawn = {t.number: t.user_attrs["values"] for t in sweep.study.get_trials(deepcopy=False)}
    return {
        "steps": result.steps_trained,
        "seconds": round(seconds, 1),
        "best": result.best.value,
        "best_trial": result.best.trial,
        "final_rungs": [r.steps for r in result.trials],
        "values": drawn,
    }


def random_search(
    spec: Any, launch: Launcher, workers: int, home: Path, values: dict[int, Any]
) -> dict[str, Any]:
    """Every trial (the settings ASHA's trial of the same number drew) trained to the full budget."""
    top = spec.budget.max_steps
    launch.arm(settings_for(home))
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        finals = list(
            pool.map(
                lambda n: launch(spec.trial_params(values[n], f"random-t{n:03d}", top))["val_bpc"],
                sorted(values),
            )
        )
    seconds = time.perf_counter() - started
    best = min(range(len(finals)), key=lambda n: finals[n])
    return {"steps": launch.steps, "seconds": round(seconds, 1), "best": finals[best], "best_trial": best}


def optuna_pruner(spec: Any, launch: Launcher, workers: int, home: Path) -> dict[str, Any]:
    """The stage before ASHA: trials one after another on each worker, each rung by rung, stopped where
    Optuna's ``SuccessiveHalvingPruner`` says so (its promotion rule for trials it cannot suspend)."""
    import optuna

    from tasks.sweep.engine import run_name, sampler_for, suggest

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="minimize",
        pruner=optuna.pruners.SuccessiveHalvingPruner(
            min_resource=spec.asha.min_steps, reduction_factor=spec.asha.eta, min_early_stopping_rate=0
        ),
    )
    rungs, lock = spec.rungs(), threading.Lock()
    launch.arm(settings_for(home))
    finished: list[tuple[int, int, float]] = []  # (trial, steps, value)

    def work() -> None:
        while True:
            with lock:
                number = len(study.trials)
                if number >= spec.budget.trials:
                    return
                study.sampler = sampler_for(spec, number)
                trial = study.ask()
                values = suggest(trial, spec)
            for rung in rungs:
                value = float(
                    launch(spec.trial_params(values, run_name("pruner", trial.number), rung))["val_bpc"]
                )
                with lock:
                    trial.report(value, rung)
                    stop = rung != rungs[-1] and trial.should_prune()
                if stop or rung == rungs[-1]:
                    with lock:
                        study.tell(
                            trial,
                            None if stop else value,
                            state=optuna.trial.TrialState.PRUNED if stop else None,
                        )
                        finished.append((trial.number, rung, value))
                    break

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(work) for _ in range(workers)]:
            future.result()
    seconds = time.perf_counter() - started
    complete = [(value, number) for number, steps, value in finished if steps == rungs[-1]]
    best_value, best_trial = min(complete)
    return {
        "steps": launch.steps,
        "seconds": round(seconds, 1),
        "best": best_value,
        "best_trial": best_trial,
        "final_rungs": [steps for _, steps, _ in sorted(finished)],
    }


def one_run(seed: int, workers: int, args: Any, corpus: str, home: Path) -> dict[str, Any]:
    spec = spec_for(seed, args, corpus)
    launch = Launcher(workers)
    try:
        here = home / f"seed-{seed}-workers-{workers}"
        # A step of each batch size on each process before any clock: a process's first fit of a
        # shape compiles the gates for it.
        launch.arm(settings_for(here / "warm-up"))
        shapes = [{"lr": 1e-3, "batch_size": b} for b in spec.batch_values() for _ in range(workers)]
        with ThreadPoolExecutor(workers) as pool:
            list(
                pool.map(
                    lambda n: launch(spec.trial_params(shapes[n], f"warm-up-{n}", 1)), range(len(shapes))
                )
            )
        ran = asha(spec, launch, workers, here / "asha")
        values = ran.pop("values")
        arms = {
            "asha": ran,
            "random": random_search(spec, launch, workers, here / "random", values),
            "pruner": optuna_pruner(spec, launch, workers, here / "pruner"),
        }
    finally:
        launch.close()
    random = arms["random"]
    for arm in arms.values():
        arm["steps_vs_random"] = round(arm["steps"] / random["steps"], 3)
        arm["best_vs_random"] = round(arm["best"] / random["best"] - 1, 4)
    return {"seed": seed, "workers": workers, "trials": args.trials, "rungs": spec.rungs(), **arms}


def main() -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="the shared data")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts, each a run per seed")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=27)
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--eta", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    add_record_option(parser)
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import optuna
    import torch
    from tables_build import sweep_tables

    info = machine(torch.device("cpu"), optuna=optuna.__version__)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        home = Path(tmp)
        os.environ["MLSTM_HOME"] = str(home)  # the shard cache: thrown away after
        corpus = build_corpus(home / "corpus", args.data)
        for seed in range(args.seeds):
            for count in workers:
                say(f"seed {seed}, {count} worker(s): ASHA, random search, Optuna's pruner")
                rows.append(one_run(seed, count, args, corpus, home))
                say(json.dumps({k: v for k, v in rows[-1].items() if k in ("asha", "random", "pruner")}))
    settings = {k: getattr(args, k) for k in ("seeds", "trials", "max_steps", "min_steps", "eta", "seq_len")}
    results = {"machine": info, "settings": {**settings, "workers": workers}, "rows": rows}
    record("sweep", args.record, results)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"ASHA, random search and Optuna's pruner over the same trials on {describe(info)}\n")
    print(sweep_tables(results))


if __name__ == "__main__":
    main()
