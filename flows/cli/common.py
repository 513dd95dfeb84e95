"""What every sub-app of the CLI shares: the consoles, the one-line error, the progress bars."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from tasks.settings import get_settings

if TYPE_CHECKING:
    from prefect import Flow

err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="Store URI: a folder or s3://bucket/prefix. [env: MLSTM_STORE_URI]"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="key=value, repeatable: pretrain.max_steps=500, transfer.c_max_log2=4, corpus.shard_mb=64.",
    ),
]


class RichSink:
    """Shows a flow's progress as a bar per stage."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task_id: Any = None

    def stage(self, description: str, total: float) -> None:
        if self.task_id is not None:
            self.progress.update(self.task_id, completed=self.progress.tasks[self.task_id].total)
        self.task_id = self.progress.add_task(description, total=total or 1)

    def advance(self, amount: float = 1) -> None:
        if self.task_id is not None:
            self.progress.advance(self.task_id, amount)


def fail(problem: str | BaseException) -> typer.Exit:
    """Print one error line and return the exit to raise: ``raise fail(error) from None``."""
    message = problem if isinstance(problem, str) else _message(problem)
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


def _message(error: BaseException) -> str:
    """The one line a user sees for an expected failure; S3's own words get the setting to look at."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(error, ClientError | BotoCoreError | Boto3Error):
        settings = get_settings()
        where = settings.s3_endpoint_url or "AWS S3"
        return (
            f"the object store ({where}) failed after {settings.s3_max_attempts} attempts per call: "
            f"{error} [MLSTM_S3_ENDPOINT_URL, MLSTM_S3_MAX_ATTEMPTS]"
        )
    return str(error)


def user_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The errors that mean a bad input or an unreachable service, not a bug: one line, no traceback;
    ``more`` adds a command's own."""
    # What S3 says once botocore's and the task's retries are spent: an outage, a denied key.
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    from flows.runtime import ClusterUnavailable, PrefectUnavailable
    from tasks.corpus.sources import SourceError
    from tasks.store import StoreError
    from tasks.tracking import TrackingUnavailable

    return (
        SourceError, StoreError, PrefectUnavailable, ClusterUnavailable, TrackingUnavailable, ValueError,
        ClientError, BotoCoreError, Boto3Error, *more,
    )  # fmt: skip


def check_datasets(specs: list[str]) -> None:
    """Every dataset path exists here: a typo fails now, not after the corpus and the training."""
    from tasks.transfer.datasets import dataset_name

    for spec in specs:
        dataset_name(spec)


def progress_bar(unit: str = "percent", *, show: bool = True) -> Progress:
    """A bar per stage on stderr, counting percent or ``unit``s."""
    counter = (
        TaskProgressColumn()
        if unit == "percent"
        else TextColumn(f"{unit} {{task.completed:,.0f}}/{{task.total:,.0f}}")
    )
    columns = (TextColumn("{task.description:<24}"), BarColumn(), counter, TimeElapsedColumn())
    return Progress(*columns, console=err, disable=not show)


def run_flow(
    flow: Flow[..., Any], *, unit: str = "percent", show_progress: bool = True, **parameters: Any
) -> Any:
    """Run a flow in this process against the configured Prefect API (or a temporary one), with a
    progress bar per stage on stderr."""
    from flows import progress
    from flows.runtime import prefect_api

    bar = progress_bar(unit, show=show_progress)
    with prefect_api(get_settings()), bar, progress.reporting_to(RichSink(bar)):
        return flow(**parameters)


def load_registered(model: str | None) -> tuple[Any, str]:
    """The MLflow pyfunc model at ``model`` (default: the champion) and its URI, or one clear line."""
    from tasks.tracking import connect

    settings = get_settings()
    connect(settings)
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException

    uri = model or f"models:/{settings.model_name}@champion"
    try:
        return mlflow.pyfunc.load_model(uri), uri
    except MlflowException as error:
        raise fail(
            f"cannot load {uri} from {settings.resolved_mlflow_tracking_uri}: {error.message}"
        ) from None
