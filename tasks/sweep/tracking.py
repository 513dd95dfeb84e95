"""The sweep in MLflow: one parent run, each trial's pretraining run a child of it, plots at the end.

The child runs are the trials' own training runs (the job logs its loss, val_bpc and params there);
the sweep adds to each the objective at every rung, the rung reached and its state (suspended,
promoted, complete, pruned).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from tasks.settings import Settings
from tasks.sweep.spec import SweepSpec

if TYPE_CHECKING:
    import optuna
    from matplotlib.figure import Figure

    from tasks.sweep.result import SweepResult


def open_parent(spec: SweepSpec, settings: Settings, study: optuna.Study, tags: dict[str, str]) -> str:
    """The sweep's parent run: the one the study remembers (a continued sweep), else a new one."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking import connect

    experiment = connect(settings)
    client = MlflowClient()
    known = study.user_attrs.get("mlflow_run_id")
    if known:
        client.update_run(known, status="RUNNING")
        return str(known)
    run = client.create_run(
        experiment.experiment_id,
        run_name=spec.sweep_id(),
        tags={"stage": "sweep", "sweep_id": spec.sweep_id(), "manifest_uri": spec.corpus, **tags},
    )
    run_id = str(run.info.run_id)
    params = {
        "objective": spec.objective,
        "sampler": spec.sampler,
        "seed": spec.seed,
        "trials": spec.budget.trials,
        "max_steps": spec.budget.max_steps,
        "min_steps": spec.asha.min_steps,
        "eta": spec.asha.eta,
        "rungs": ",".join(map(str, spec.rungs())),
        **{f"fixed.{k}": v for k, v in spec.fixed.items()},
    }
    for key, value in params.items():
        client.log_param(run_id, key, value)
    client.log_dict(run_id, spec.model_dump(mode="json"), "sweep_spec.json")
    study.set_user_attr("mlflow_run_id", run_id)
    return run_id


def record_rung(
    sweep_id: str, trial: int, run_id: str | None, rungs: list[int], rung: int, value: float, state: str
) -> None:
    """A trial's objective at a rung (``rung`` steps, one of ``rungs``) and its state there
    (suspended, or complete at the last rung), on the trial's own run."""
    if not run_id:
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    client.log_metric(run_id, "objective", value, step=rung)
    client.set_tag(run_id, "sweep_id", sweep_id)
    client.set_tag(run_id, "sweep_trial", str(trial))
    client.set_tag(run_id, "sweep_rung", f"{rungs.index(rung) + 1} of {len(rungs)} ({rung} steps)")
    client.set_tag(run_id, "sweep_state", state)


def record_state(run_id: str | None, state: str) -> None:
    """A trial promoted from its rung, or left there (pruned) as the sweep ends."""
    if not run_id:
        return
    from mlflow.tracking import MlflowClient

    MlflowClient().set_tag(run_id, "sweep_state", state)


def close_parent(run_id: str, study: optuna.Study, result: SweepResult, rungs: list[int]) -> None:
    """Plots, the trial table, the best trial tagged; the parent run ends FINISHED."""
    from mlflow.tracking import MlflowClient

    from tasks.sweep.engine import rung_history

    client = MlflowClient()
    client.log_dict(run_id, result.shown(), "sweep.json")
    history = rung_history(study)
    rows = [row.model_dump() for row in result.trials]
    for name, figure in (
        ("objective_by_trial.png", objective_by_trial(rows, rungs)),
        ("objective_by_step.png", objective_by_step(history, rungs)),
        ("parallel_coordinates.png", parallel_coordinates(study)),
    ):
        if figure is not None:
            client.log_figure(run_id, figure, name)
    best = result.best
    client.log_metric(run_id, "steps_trained", float(result.steps_trained))
    if best:
        client.log_metric(run_id, "best_value", best.value)
        for key, value in (
            ("trial", best.trial),
            ("run", best.run),
            ("checkpoint_uri", best.checkpoint_uri),
            ("run_id", best.run_id),
        ):
            if value is not None:
                client.set_tag(run_id, f"best_{key}", str(value))
        if best.run_id:
            client.set_tag(best.run_id, "sweep_best", "true")
            client.set_tag(best.run_id, "sweep_best_checkpoint_uri", str(best.checkpoint_uri))
    client.set_terminated(run_id, "FINISHED")


def _figure(width: float) -> tuple[Figure, Any]:
    """A figure and its axes outside pyplot: nothing global to close, nothing left behind in a long
    process (the flow's worker, a test session), as the probe's plots are made."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, 4))
    return figure, figure.add_subplot()


def objective_by_trial(rows: list[dict[str, Any]], rungs: list[int]) -> Figure:
    """Each trial's objective at the last rung it reached, coloured by that rung; failed ones in red."""
    from matplotlib import colormaps

    figure, axes = _figure(7)
    colours = colormaps["viridis"]
    for index, steps in enumerate(rungs):
        points = [
            (r["trial"], r["value"])
            for r in rows
            if r["rung"] == index + 1 and r["state"] != "failed" and r["value"] is not None
        ]
        if points:
            colour = colours(index / max(len(rungs) - 1, 1))
            axes.scatter(*zip(*points, strict=True), label=f"rung {index + 1} ({steps} steps)", color=colour)
    failed = [(r["trial"], r["value"]) for r in rows if r["state"] == "failed" and r["value"] is not None]
    if failed:
        axes.scatter(*zip(*failed, strict=True), label="failed", color="tab:red", marker="x")
    axes.set(xlabel="trial", ylabel="val bits per character (last rung reached)", title="objective by trial")
    axes.legend()
    axes.grid(alpha=0.3)
    return figure


def objective_by_step(history: dict[int, dict[int, float]], rungs: list[int]) -> Figure:
    """Each trial's objective at the rungs it reached; a dotted line at every rung."""
    figure, axes = _figure(7)
    for rung in rungs:
        axes.axvline(rung, color="grey", linestyle=":", linewidth=1)
    for number, values in sorted(history.items()):
        steps = sorted(values)
        axes.plot(steps, [values[s] for s in steps], marker="o", label=f"trial {number}")
    axes.set(xlabel="steps (rungs)", ylabel="val bits per character", title="objective by step per trial")
    axes.set_xscale("log")
    if rungs:
        axes.set_xticks(rungs, [str(s) for s in rungs])
        axes.minorticks_off()
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return figure


def parallel_coordinates(study: optuna.Study) -> Figure | None:
    """Each trial as a line through its parameters to its objective (its last rung's value)."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.intermediate_values]
    if not trials:
        return None
    names = sorted({name for t in trials for name in t.params})
    figure, axes = _figure(8)
    columns = [*names, "objective"]

    def position(name: str, value: Any, all_values: list[Any]) -> float:
        if isinstance(value, str) or any(isinstance(v, str) for v in all_values):
            ordered = sorted({str(v) for v in all_values})
            return ordered.index(str(value)) / max(len(ordered) - 1, 1)
        numbers = [float(v) for v in all_values]
        low, high = min(numbers), max(numbers)
        log = name == "lr" and low > 0
        x, lo, hi = (
            (math.log(float(value)), math.log(low), math.log(high)) if log else (float(value), low, high)
        )
        return (x - lo) / (hi - lo) if hi > lo else 0.5

    table = [{**t.params, "objective": t.intermediate_values[max(t.intermediate_values)]} for t in trials]
    for trial, row in zip(trials, table, strict=True):
        ys = [position(c, row[c], [r[c] for r in table]) for c in columns]
        axes.plot(range(len(columns)), ys, marker="o", alpha=0.7, label=f"trial {trial.number}")
    axes.set_xticks(range(len(columns)), columns)
    axes.set_yticks([])
    axes.set_title("parallel coordinates (each axis scaled to its range; lr on a log scale)")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    figure.tight_layout()
    return figure
