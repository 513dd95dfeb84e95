"""The ``mlstm-sentiment`` command: run any stage, or the whole job, from a terminal.

A thin entry: each stage's commands live in a sub-app of their own module, mounted here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from flows.cli import (
    checkpoints,
    corpus,
    finetune,
    neuron,
    operate,
    pipeline,
    predict,
    pretrain,
    probe,
    score,
    sweep,
    transfer,
)
from flows.cli.common import fail, user_errors
from tasks.settings import get_settings

app = typer.Typer(
    name="mlstm-sentiment",
    help="From raw Amazon reviews to a served sentiment classifier: corpus → mLSTM → probe → MLflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(corpus.app, name="corpus", rich_help_panel="Corpus")
app.add_typer(sweep.app, name="sweep", rich_help_panel="Sweep")
app.add_typer(checkpoints.app, name="checkpoints", rich_help_panel="Operate")
# The other stages' commands sit at the top level (`mlstm-sentiment pretrain …`), grouped by stage.
for stage in (pretrain, transfer, finetune, predict, score, probe, neuron, pipeline, operate):
    app.add_typer(stage.app)


@app.callback()
def _global_options(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show Prefect's and MLflow's logs.")
    ] = False,
) -> None:
    """Quiet consoles by default: flow logs still reach the Prefect API (and its UI) in full."""
    os.environ["MLSTM_CLI_VERBOSE"] = "1" if verbose else ""
    level = "INFO" if verbose else "WARNING"
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", level)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", level)
    if not verbose:  # set before Prefect configures its logging, here and in every worker process
        os.environ.setdefault(
            "PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS", "flows.console.ConsoleWithoutTracebacks"
        )


def _prefect_home_in_ours(home: Path) -> None:
    """The temporary Prefect API keeps its database (flow-run parameters, names, logs) in MLSTM_HOME, as
    MLflow's is, not in one ~/.prefect shared by every home; a user's own PREFECT_HOME or API is kept, and
    so is their profile (a `prefect config set` there still applies)."""
    if os.environ.get("PREFECT_HOME") or os.environ.get("PREFECT_API_URL"):
        return
    os.environ.setdefault("PREFECT_PROFILES_PATH", str(Path.home() / ".prefect" / "profiles.toml"))
    prefect = home / "prefect"
    prefect.mkdir(
        parents=True, exist_ok=True
    )  # Prefect makes only the last folder: a new MLSTM_HOME has none
    os.environ["PREFECT_HOME"] = str(prefect)


def _caches_in_ours(home: Path) -> None:
    """Matplotlib's config and font cache (the plots of transfer, sweeps and the pipeline) in MLSTM_HOME,
    not the user's ~/.config and ~/.cache; a user's own MPLCONFIGDIR is kept."""
    os.environ.setdefault("MPLCONFIGDIR", str(home / "cache" / "matplotlib"))


def main() -> None:
    # This machine's own tools need no phoning home; users can still turn either back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # MLflow prints a link to each run it ends on stdout, which --json keeps for the result alone.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    try:
        home = get_settings().home.resolve()  # the same from any folder; read once at start-up
        _prefect_home_in_ours(home)
        _caches_in_ours(home)
        app()
    except user_errors(OSError) as error:
        # A bad input or an unreachable service that a command did not catch itself is still one line
        # (an OSError names its file); --verbose shows the traceback.
        if os.environ.get("MLSTM_CLI_VERBOSE"):
            raise
        sys.exit(fail(error).exit_code)
