"""``mlstm-sentiment pipeline | run | status``: the whole job, reruns of a stage, and what ran."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from flows.cli.common import (
    JsonOption,
    SetOption,
    check_datasets,
    err,
    fail,
    options_from,
    out,
    run_flow,
    styled,
    user_errors,
)
from tasks.pipeline import PipelineParams, PretrainStage, TransferStage
from tasks.settings import get_settings

if TYPE_CHECKING:
    from tasks.pipeline.record import PipelineResult
    from tasks.pretrain.result import PretrainResult

app = typer.Typer()
PANEL = "Pipeline"


def pipeline_values(**flags: Any) -> dict[str, Any]:
    """Default pipeline parameters as a plain dict, for flags and ``--set`` to change."""
    return PipelineParams.model_construct().model_dump(mode="json") | flags


def run_pipeline(params: PipelineParams, *, show_progress: bool = True) -> PipelineResult:
    """The whole pipeline (or the stages ``params.stages`` names) as a Prefect flow run, here."""
    from tasks.tracking import connect

    check_datasets(params.transfer.datasets if "transfer" in params.stages else [])
    if "finetune" in params.stages and params.finetune.dataset:
        check_datasets([params.finetune.dataset])
    # MLflow down: one clear error before any flow run or MLflow run exists, and before every stage's
    # code is imported (seconds of torch, scipy and MLflow's own modules).
    connect(get_settings())
    from flows.pipeline import pipeline as pipeline_flow

    return run_flow(pipeline_flow, show_progress=show_progress, params=params)


# The stages' settings the pipeline takes as flags (the rest through --set), each declared once, in the
# stage's model: the pipeline's stages override only what they fill in themselves.
STAGE_FLAGS = {"transfer": ("datasets",), "pretrain": ("preset", "launcher", "max_steps")}
OWN_FLAGS = ("incremental",)  # the pipeline's own settings taken as flags


@app.command("pipeline", rich_help_panel=PANEL)
@options_from(PipelineParams, OWN_FLAGS)
@options_from(PretrainStage, STAGE_FLAGS["pretrain"])
@options_from(TransferStage, STAGE_FLAGS["transfer"])
def pipeline_command(
    sources: Annotated[
        list[str] | None,
        typer.Argument(
            help="Raw reviews: files, folders, globs, s3:// or http(s)://. Not with --from-sweep."
        ),
    ] = None,
    force: Annotated[
        list[str] | None, typer.Option(help="Run this stage even if its inputs are unchanged; repeatable.")
    ] = None,
    from_sweep: Annotated[
        str | None,
        typer.Option(help="A sweep id: its best trial's checkpoint goes on to transfer and the registry."),
    ] = None,
    finetune: Annotated[
        bool,
        typer.Option(
            "--finetune",
            help="After transfer, also fine-tune the mLSTM and a head on the first --dataset (docs/finetune.md; "
            "its settings: --set finetune.KEY=VALUE) and register it as a challenger.",
        ),
    ] = False,
    set_: SetOption = None,
    as_json: JsonOption = False,
    **settings: Any,
) -> None:
    """Run corpus → pretrain → transfer → register under one MLflow run; unchanged stages are skipped."""
    from tasks.pipeline import apply_overrides, validated

    try:
        if from_sweep and sources:
            raise ValueError(
                "--from-sweep: the sweep's trials already trained on their corpus; give no SOURCES"
            )
        if not from_sweep and not sources:
            raise ValueError("SOURCES: give raw review files or URLs, or --from-sweep SWEEP")
        values = pipeline_values(sources=sources or [], force=force or [])
        values.update({name: settings[name] for name in OWN_FLAGS})
        if from_sweep:
            values.update(from_sweep=from_sweep, stages=["transfer"])
        if finetune:
            values["stages"] = [*values["stages"], "finetune"]
        for stage, names in STAGE_FLAGS.items():
            values[stage].update({name: settings[name] for name in names})
        params = validated(apply_overrides(values, set_ or []))
        result = run_pipeline(params)
    except user_errors() as error:
        raise fail(error) from None
    print_pipeline(result, as_json=as_json)


def _trained(result: PretrainResult) -> str:
    """The pretrain stage's line: a val split shorter than one batch row leaves no val bpc."""
    val = (
        "no val bpc (val split too short)"
        if result.val_bpc is None
        else f"val {result.val_bpc:.2f} bits/byte"
    )
    return f"step {result.steps:,}, {val}"


def print_pipeline(result: PipelineResult, *, as_json: bool) -> None:
    """A pipeline run's stages and outputs: a table, or one JSON object on stdout."""
    if as_json:
        print(json.dumps(result.shown(), default=str))
        return
    table = Table(title=f"pipeline run {result.run_id}")
    for column in ("stage", "state", "result", "MLflow run"):
        table.add_column(column, no_wrap=column != "result")
    outputs = {
        "corpus": f"{result.corpus.rows:,} rows" if result.corpus else "-",
        "pretrain": _trained(result.pretrain) if result.pretrain else "-",
        "transfer": ", ".join(f"{n} test {v.test_accuracy:.2%}" for n, v in result.transfer.datasets.items())
        if result.transfer
        else "-",
        "finetune": f"{result.finetune.dataset} test {result.finetune.test_accuracy:.2%}"
        if result.finetune
        else "-",
    }
    for stage, info in result.stages.items():
        color = {"ran": "green", "skipped": "cyan"}.get(info.state, "red")
        table.add_row(stage, styled(info.state, color), outputs[stage], str(info.run_id or "-")[:12])
    out.print(table)
    if result.corpus:
        out.print(f"manifest: {result.corpus.manifest_uri}", highlight=False)
    if result.pretrain:
        out.print(f"checkpoint: {result.pretrain.checkpoint_uri}", highlight=False)
    registered = result.transfer.registered if result.transfer else None
    if registered and result.stages["transfer"].state == "skipped":
        out.print(f"model: {registered.name} v{registered.version}, unchanged", highlight=False)
    elif registered:
        out.print(f"registered {registered.name} v{registered.version}: {registered.reason}", highlight=False)


StageArgument = Annotated[str, typer.Argument(help="corpus, pretrain, transfer or finetune.")]


@app.command("run", rich_help_panel=PANEL)
def run_stage(
    stage: StageArgument,
    from_: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="A pipeline's MLflow run id (its parameters and outputs are reused), or a manifest URI "
            "(pretrain) or checkpoint URI (transfer, finetune). [default: the newest pipeline run, if any]",
        ),
    ] = None,
    set_: SetOption = None,
    rest: Annotated[bool, typer.Option("--rest", help="Run the later stages too.")] = False,
    deployment: Annotated[
        str | None,
        typer.Option(
            help="Run through this deployment (e.g. pipeline/pipeline-weekly) on a worker, not here."
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Rerun one stage (or, with --rest, the rest of the pipeline) on demand, here or on a worker."""
    from tasks.pipeline import STAGES, apply_overrides, stages_from, validated

    if stage not in STAGES:
        raise fail(f"unknown stage {stage!r}: choose corpus, pretrain, transfer or finetune")
    try:
        values = _rerun_values(stage, from_)
        values.update(stages=stages_from(stage, rest=rest), force=[stage])
        params = validated(apply_overrides(values, set_ or []))
        # Through a deployment, dataset paths are the worker's: run_pipeline checks them here.
        result = run_through_deployment(deployment, params) if deployment else run_pipeline(params)
    except user_errors() as error:
        raise fail(error) from None
    print_pipeline(result, as_json=as_json)


def _rerun_values(stage: str, origin: str | None) -> dict[str, Any]:
    """The parameters a rerun starts from: a past pipeline run's (the newest by default) or a URI's."""
    from tasks.pipeline.record import pipeline_params_of, recent_pipelines
    from tasks.tracking import nothing_tracked

    settings = get_settings()
    if origin and ("/" in origin or ":" in origin):
        if stage == "corpus":
            raise ValueError("--from URI is a manifest (for pretrain) or a checkpoint (for transfer); "
                             "the corpus stage reads --set sources=…")  # fmt: skip
        key = "manifest_uri" if stage == "pretrain" else "checkpoint_uri"
        return pipeline_values(**{key: origin})
    if origin is None:
        newest = [] if nothing_tracked(settings) else recent_pipelines(settings, 1)
        if not newest:  # a fresh install: the defaults, and --set says the rest
            return pipeline_values()
        origin = newest[0]["run_id"]
    values, tags = pipeline_params_of(origin, settings)
    values["manifest_uri"] = tags.get("manifest_uri") or values.get("manifest_uri")
    values["checkpoint_uri"] = tags.get("checkpoint_uri") or values.get("checkpoint_uri")
    return values


def run_through_deployment(name: str, params: PipelineParams) -> PipelineResult:
    """Create a run of a pipeline deployment, follow its state and logs until it ends; its result is
    read back from the MLflow run it made."""
    from flows.runtime import configured_api_url, follow_flow_run, prefect_api, submit_deployment
    from tasks.pipeline.record import pipeline_result_of

    settings = get_settings()
    if not configured_api_url(settings):
        raise ValueError(
            "--deployment needs a Prefect server: set PREFECT_API_URL (or MLSTM_PREFECT_API_URL)"
        )
    with prefect_api(settings):
        flow_run_id = submit_deployment(name, {"params": params.model_dump(mode="json")})
        err.print(f"flow run {flow_run_id} of {name}: waiting for a worker", highlight=False)
        state = follow_flow_run(
            flow_run_id, on_log=lambda line: err.print(line, style="dim", highlight=False)
        )
    if state != "COMPLETED":
        raise ValueError(f"flow run {flow_run_id} of {name} ended {state}; its logs are in the Prefect UI")
    return pipeline_result_of(flow_run_id, settings)


@app.command(rich_help_panel=PANEL)
def status(
    limit: Annotated[int, typer.Option(min=1, help="How many runs.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines.")] = False,
) -> None:
    """Recent pipeline runs: their stages, metrics and model versions (from MLflow)."""
    from tasks.tracking import nothing_tracked

    settings = get_settings()
    if nothing_tracked(settings):  # a fresh home: no need to load MLflow to say so
        if not as_json:
            err.print(
                f"no pipeline runs yet ({settings.shown_mlflow_tracking_uri}): `mlstm-sentiment demo` runs one"
            )
        return
    from tasks.pipeline.record import recent_pipelines

    try:
        runs = recent_pipelines(settings, limit)
    except user_errors() as error:
        raise fail(error) from None
    if as_json:
        for run in runs:
            print(json.dumps(run))
        return
    table = Table(title=f"pipeline runs ({settings.shown_mlflow_tracking_uri})")
    for column in (
        "started (UTC)",
        "status",
        "corpus",
        "pretrain",
        "transfer",
        "metrics",
        "probe vs baseline",
        "model",
        "MLflow run",
        "incremental",
    ):
        table.add_column(column, overflow="fold")
    for run in runs:
        metrics = ", ".join(
            f"{k} {v:.4g}"
            for k, v in sorted(run["metrics"].items())
            if k != "corpus_rows" and not k.endswith("_baseline_test_accuracy")
        )
        versus = "; ".join(
            f"{name} {v['test_accuracy']:.2%} vs {v['baseline_test_accuracy']:.2%} ({v['difference'] * 100:+.2f} pts)"
            for name, v in run["vs_baseline"].items()
        )
        table.add_row(
            run["started"].replace("T", " ").removesuffix("+00:00"), run["status"],
            *run["stages"].values(), metrics or "-", versus or "-", f"v{run['model_version']}" if run["model_version"] else "-",
            run["run_id"], run["incremental"] or "-",
        )  # fmt: skip
    out.print(table)
