"""``mlstm-sentiment demo | deploy | promote | settings``: run it once, then run it as a team."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import err, fail, out, styled, user_errors
from flows.cli.pipeline import print_pipeline, run_pipeline
from tasks.secrets import redact
from tasks.settings import Settings, get_settings
from tasks.signing import key_name

app = typer.Typer()
PANEL = "Operate"

# In the generated reviews' words: the demo's tiny mLSTM has read nothing else.
DEMO_POSITIVE = "Absolutely love it! I would buy this tuner again in a heartbeat."
DEMO_NEGATIVE = "Very disappointed. I returned the tuner immediately."


@app.command(rich_help_panel=PANEL)
def demo(
    reviews: Annotated[int, typer.Option(help="Reviews in the generated sample.")] = 3000,
    steps: Annotated[int, typer.Option(min=1, help="Pretraining steps of the tiny mLSTM.")] = 300,
) -> None:
    """Run the whole pipeline on embedded defaults, then serve the model and ask it twice.

    A generated sample, its corpus, a tiny mLSTM, its probe, the registered classifier, served with
    `mlflow models serve` and asked for two predictions.
    """
    from tasks.corpus.config import CorpusConfig
    from tasks.corpus.sample import write_labelled_sample, write_sample
    from tasks.pipeline import PipelineParams, PretrainStage, TransferStage
    from tasks.transfer.serve import invoke, serve_command, served

    settings = get_settings()
    err.print(styled("mlstm-sentiment demo", "bold"), f"· home {settings.home.resolve()}")
    sample = write_sample(settings.home / "sample", num_reviews=reviews)
    labelled = write_labelled_sample(settings.home / "sample-labelled")
    err.print(
        f"1. generated {reviews:,} reviews in the 2014, 2018 and 2023 Amazon formats ({sample[0].parent}), "
        f"and held-out reviews labelled by their stars ({labelled})"
    )
    err.print(f"2. the pipeline: corpus → a tiny mLSTM ({steps} steps or one epoch) → probe → registry")
    params = PipelineParams(
        sources=[str(sample[0].parent)],
        # A sample this small needs bigger held-out splits than the paper's 1000:1:1 to be useful.
        corpus=CorpusConfig(split=(90, 5, 5)),
        pretrain=PretrainStage(
            preset="tiny", batch_size=16, seq_len=64, lr=3e-3, max_steps=steps,
            checkpoint_every=steps, val_every=steps, retries=0,
        ),
        transfer=TransferStage(datasets=[f"reviews={labelled}"]),
    )  # fmt: skip
    try:
        result = run_pipeline(params)
    except user_errors() as error:
        raise fail(error) from None
    print_pipeline(result, as_json=False)
    model_uri = f"models:/{settings.model_name}@champion"
    err.print(f"3. serving {model_uri} with `mlflow models serve` and POSTing two reviews:")
    try:
        with served(
            model_uri, settings.resolved_mlflow_tracking_uri, log=settings.home / "logs" / "serve.log"
        ) as url:
            predictions = invoke(url, [DEMO_POSITIVE, DEMO_NEGATIVE])
    except RuntimeError as error:
        raise fail(error) from None
    for text, prediction in zip((DEMO_POSITIVE, DEMO_NEGATIVE), predictions, strict=True):
        color = "green" if prediction["label"] == "positive" else "red"
        out.print(" ", styled(f"{prediction['label']:>8}", color), f"{prediction['probability']:.3f}  {text}")
    out.print("\nLook at it:")
    out.print("  mlstm-sentiment status            # pipeline runs, their stages and models", highlight=False)
    for line in _where_to_look(settings, result.run_id):
        out.print(f"  {line}", highlight=False, soft_wrap=True)
    out.print(f'  model: {model_uri}  (`mlstm-sentiment predict "…"`)', highlight=False)
    out.print(
        "  "
        + serve_command(
            model_uri,
            settings.shown_mlflow_tracking_uri,
            registry_uri=settings.resolved_mlflow_registry_uri,
        ),
        highlight=False,
        soft_wrap=True,
        markup=False,
    )


def _where_to_look(settings: Settings, run_id: str) -> list[str]:
    """The pipeline run in the MLflow and Prefect UIs: links to the servers in use, or how to start
    local ones on the demo's own files."""
    from mlflow.tracking import MlflowClient

    from flows.runtime import configured_api_url
    from tasks.tracking import experiment_id, ui_base

    experiment = experiment_id(settings)  # connects MLflow before the client is made
    flow_run_id = MlflowClient().get_run(run_id).data.tags.get("prefect_flow_run_id", "")
    mlflow_base = ui_base(settings)
    lines = [
        f"MLflow run: {mlflow_base}/#/experiments/{experiment}/runs/{run_id}"
        if mlflow_base
        else f"mlflow ui --backend-store-uri {settings.shown_mlflow_tracking_uri}   # run {run_id}"
    ]
    prefect_api = configured_api_url(settings)
    if prefect_api:
        lines.append(
            f"Prefect flow run: {prefect_api.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"
        )
    else:
        lines.append(
            f"PREFECT_HOME={settings.home.resolve() / 'prefect'} prefect server start"
            f"    # then http://127.0.0.1:4200/runs/flow-run/{flow_run_id}: "
            "the flow run, its subflows and artifacts"
        )
    return lines


@app.command(rich_help_panel=PANEL)
def deploy(
    file: Annotated[Path, typer.Option(help="The Prefect deployment file.")] = Path("infra/prefect.yaml"),
    name: Annotated[list[str] | None, typer.Option(help="Only this deployment; repeatable.")] = None,
) -> None:
    """Create the work pools and concurrency limits infra/prefect.yaml names, then deploy every deployment."""
    from flows.deploy import DeployError
    from flows.deploy import deploy as deploy_file
    from flows.runtime import configured_api_url, prefect_api

    settings = get_settings()
    if not configured_api_url(settings):
        raise fail("deploy needs a Prefect server: set PREFECT_API_URL (or MLSTM_PREFECT_API_URL)")
    try:
        with prefect_api(settings) as url:
            lines = deploy_file(file, name)
    except user_errors(DeployError) as error:
        raise fail(error) from None
    for line in lines:
        out.print(line, highlight=False)
    out.print(f"at {url}; start workers with `prefect worker start --pool NAME`", highlight=False)


@app.command(rich_help_panel=PANEL)
def promote(
    version: Annotated[int, typer.Argument(help="The model version to make @champion.")],
    reason: Annotated[
        str, typer.Option(help="Why (kept in the version's promotion tag).")
    ] = "promoted by hand",
) -> None:
    """Point @champion at a version by hand: a promotion, or a rollback to an earlier version."""
    from tasks.transfer.registry import promote as promote_version

    try:
        done = promote_version(version, get_settings(), reason=reason)
    except user_errors() as error:
        raise fail(error) from None
    before = f"v{done['previous']}" if done["previous"] else "no champion"
    out.print(f"{done['name']}@champion: {before} → v{done['version']}", highlight=False)


@app.command("settings", rich_help_panel=PANEL)
def show_settings() -> None:
    """Print the settings in force (from MLSTM_* variables and defaults)."""
    settings = get_settings()
    values = settings.model_dump(mode="json")
    values["resolved_store_uri"] = settings.resolved_store_uri
    values["resolved_mlflow_tracking_uri"] = settings.resolved_mlflow_tracking_uri
    values["mlflow_tracking_uri_from"] = settings.mlflow_tracking_uri_source[1]
    values["resolved_mlflow_registry_uri"] = settings.resolved_mlflow_registry_uri
    values["mlflow_registry_uri_from"] = settings.mlflow_registry_uri_source[1]
    # Where the checkpoint key comes from, never the key: the variable, else the home's file.
    values["checkpoint_key_from"] = key_name()
    # A URI's password is the user's to keep: shown redacted, like everywhere else.
    print(json.dumps({k: redact(v) if isinstance(v, str) else v for k, v in values.items()}, indent=2))
