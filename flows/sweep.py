"""The sweep flow: ASHA over the pretraining job, each launch of a trial to a rung a ``pretrain`` subflow run.

A rung's launch is the ``pretrain`` flow on the trial's run name with a larger ``max_steps``: it holds
a slot of the GPU concurrency limit (two trials never share GPUs), uses the configured launcher
(local torchrun, Slurm, Kubernetes), resumes from the run's checkpoint, and logs into the trial's
MLflow run, a child of the sweep's parent run. Run the same spec again and the sweep continues.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import get_run_context

from flows import names
from flows.pretrain import pretrain
from tasks.pretrain.config import PretrainParams
from tasks.pretrain.result import PretrainResult
from tasks.settings import get_settings
from tasks.sweep.engine import Sweep, prepare
from tasks.sweep.result import SweepResult
from tasks.sweep.spec import SweepSpec
from tasks.sweep.tracking import close_parent, open_parent, record_rung, record_state
from tasks.tracking import experiment_id, run_link


@flow(name="sweep", flow_run_name=names.sweep_name)
def sweep(spec: SweepSpec, parallel: int = 1) -> SweepResult:
    """Search pretraining settings with ASHA; trials suspend at each rung, promoted ones resume.

    Args:
        spec: The search: corpus, fixed settings, space, sampler, budget and rungs.
        parallel: Trials to run at once (each holds a GPU slot while it trains).
    """
    if parallel < 1:
        raise ValueError(f"--parallel {parallel}: run at least one trial at a time")
    logger = get_run_logger()
    settings = get_settings()
    spec = prepare(spec, settings)  # a spec that cannot run fails here, before any trial
    sweep_id = spec.sweep_id()
    parent_run_id = ""

    def launch(params: PretrainParams) -> PretrainResult:
        logger.info("trial run %s: training to step %s", params.run, params.max_steps)
        named = pretrain.with_options(flow_run_name=f"pretrain-{params.run}-to-{params.max_steps}")
        return named(params, parent_run_id=parent_run_id)

    rungs = spec.rungs()

    def on_rung(trial: int, run_id: str | None, rung: int, value: float, state: str) -> None:
        logger.info("trial %d at step %d: val_bpc %.4f, %s", trial, rung, value, state)
        record_rung(sweep_id, trial, run_id, rungs, rung, value, state)

    def on_state(trial: int, run_id: str | None, state: str) -> None:
        logger.info("trial %d %s", trial, state)
        record_state(run_id, state)

    engine = Sweep(spec, settings, launch, on_rung=on_rung, on_state=on_state)
    flow_run_id = str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    parent_run_id = open_parent(spec, settings, engine.study, {"prefect_flow_run_id": flow_run_id})
    logger.info("sweep %s: rungs at %s steps, %d trials", sweep_id, spec.rungs(), spec.budget.trials)
    result = engine.run(parallel).model_copy(update={"mlflow_run_id": parent_run_id})
    close_parent(parent_run_id, engine.study, result, rungs)
    create_table_artifact(
        key="sweep-trials",
        table=[row.model_dump() for row in result.trials],
        description=f"sweep {sweep_id}: every trial, its state, steps and objective (val_bpc)",
    )
    best = result.best
    create_markdown_artifact(
        key="sweep-result",
        markdown=(
            f"# Sweep `{sweep_id}`\n\n- {len(result.trials)} trials, {result.steps_trained} steps "
            "trained\n"
            + (
                f"- best: trial {best.trial} `{best.params}`, val bpc {best.value:.4f}, run "
                f"`{best.run}`\n- checkpoint: `{best.checkpoint_uri}`\n"
                if best
                else "- no trial completed\n"
            )
            + f"- MLflow parent run: {run_link(settings, experiment_id(settings), parent_run_id)}\n"
        ),
        description="The best trial and where its checkpoint is",
    )
    return result
