"""What every sub-app of the CLI shares: the consoles, the one-line error, the progress bars."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from tasks.jobs.config import flag_errors
from tasks.secrets import redact_text
from tasks.settings import flag_of, get_settings

if TYPE_CHECKING:
    from prefect import Flow
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo

Command = TypeVar("Command", bound=Callable[..., Any])
Result = TypeVar("Result")  # what a flow returns: its stage's result model

# Markup off by default: paths, reviews and messages are the user's text, and `[/]` or `[bold]` in them must
# print as typed. Styled words are Rich Text objects (``styled``).
err = Console(stderr=True, soft_wrap=True, markup=False)
out = Console(soft_wrap=True, markup=False)


def styled(text: str, style: str) -> Text:
    """``text`` in ``style`` (``"bold green"``), to print or put in a table cell beside plain text."""
    return Text(text, style=style)


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


def options_from(model: type[BaseModel], names: Iterable[str]) -> Callable[[Command], Command]:
    """Give a command one option per field of ``model`` that ``names`` lists, in that order: ``--batch-size``
    for ``batch_size`` (or the field's ``Flag``), the field's description for help, its default, and its
    Literal's values as choices. The command takes them as ``**settings`` and builds the model
    (``parsed``), whose validation (bounds, presets) is then the only one: a setting is declared once, in
    the model."""
    options = [_option(name, model.model_fields[name]) for name in names]

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        own = [
            parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for parameter in signature.parameters.values()
            if parameter.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        # Typer reads a command's options from its signature.
        cast(Any, command).__signature__ = signature.replace(parameters=[*options, *own])
        return command

    return decorate


def _option(name: str, info: FieldInfo) -> inspect.Parameter:
    flag = flag_of(name, info)
    kind, default = (
        info.annotation,
        ... if info.is_required() else info.get_default(call_default_factory=True),
    )
    if flag.text is not None:  # the flag takes the value as text, which the model parses
        kind, default = str, flag.text(default)
    # Named only where the field's Flag says: typer names the rest, a bool as --x/--no-x.
    names = [flag.name] if flag.name and flag.name != f"--{name.replace('_', '-')}" else []
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[kind, typer.Option(*names, help=info.description)],
    )


Model = TypeVar("Model", bound="BaseModel")


def parsed(model: type[Model], settings: dict[str, Any]) -> Model:
    """``model`` from a command's flags, or the command's one-line refusal naming each bad flag."""
    from pydantic import ValidationError

    try:
        return model(**settings)
    except ValidationError as error:
        raise fail(flag_errors(error, model)) from None


class RichSink:
    """Shows a flow's progress as a bar per stage."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task_id: Any = None

    def stage(self, description: str, total: float) -> None:
        if self.task_id is not None:
            self.progress.update(self.task_id, completed=self.progress.tasks[self.task_id].total)
        # A bar's description is markup to Rich; a dataset's or file's name in it is the user's text.
        self.task_id = self.progress.add_task(escape(description), total=total or 1)

    def advance(self, amount: float = 1) -> None:
        if self.task_id is not None:
            self.progress.advance(self.task_id, amount)

    def note(self, message: str) -> None:
        # Above the bars, which stay at the bottom of the terminal.
        self.progress.console.print(Text(message), highlight=False)


def fail(problem: str | BaseException) -> typer.Exit:
    """Print one error line and return the exit to raise: ``raise fail(error) from None``."""
    # A library's message may quote a URI with its password (a database, a signed URL): never printed.
    message = redact_text(problem if isinstance(problem, str) else _message(problem))
    err.print(Text.assemble(("error:", "bold red"), f" {message}"), highlight=False)
    return typer.Exit(code=2)


def _message(error: BaseException) -> str:
    """The one line a user sees for an expected failure; S3's own words get the setting to look at."""
    if type(error).__name__ == "NoCredentialsError":  # botocore's: no retry would find them
        return (
            f"{error}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, for the object store"
        )
    if isinstance(error, _loaded(_S3_ERRORS)):
        settings = get_settings()
        where = settings.s3_endpoint_url or "AWS S3"
        return (
            f"the object store ({where}) failed after {settings.s3_max_attempts} attempts per call: "
            f"{error} [MLSTM_S3_ENDPOINT_URL, MLSTM_S3_MAX_ATTEMPTS]"
        )
    pydantic = sys.modules.get("pydantic_core")
    if pydantic and isinstance(error, pydantic.ValidationError):
        return invalid_settings(error)
    return str(error)


def invalid_settings(error: Any) -> str:
    """A pydantic ``ValidationError`` as one line naming each setting: ``split: …; max_workers: …``,
    without pydantic's model name and web link."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or 'settings'}: {item['msg'].removeprefix('Value error, ')}"
        for item in error.errors()
    )


# What S3 says once botocore's and the task's retries are spent: an outage, a denied key.
_S3_ERRORS = {"boto3.exceptions": ("Boto3Error",), "botocore.exceptions": ("BotoCoreError", "ClientError")}
# The errors that mean a bad input or an unreachable service, not a bug, by the module that defines them.
_USER_ERRORS = {
    **_S3_ERRORS,
    "flows.runtime": ("ClusterUnavailable", "PrefectUnavailable"),
    "tasks.corpus.sources": ("SourceError",),
    "tasks.store": ("StoreError",),
    "tasks.sweep.engine": ("StorageUnavailable",),
    "tasks.tracking": ("TrackingUnavailable",),
}


def _loaded(errors: dict[str, tuple[str, ...]]) -> tuple[type[BaseException], ...]:
    """The error types of ``errors`` whose modules are imported: one never imported raised nothing, and
    importing it only to name it (boto3, Prefect) would cost a refusal seconds."""
    return tuple(
        getattr(sys.modules[module], name)
        for module, names in errors.items()
        if module in sys.modules
        for name in names
    )


def user_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The errors that mean a bad input or an unreachable service, not a bug: one line, no traceback;
    ``more`` adds a command's own."""
    return (ValueError, *_loaded(_USER_ERRORS), *more)


def check_datasets(specs: list[str]) -> None:
    """Every dataset path exists here: a typo fails now, not after the corpus and the training."""
    from tasks.transfer.datasets import dataset_name

    for spec in specs:
        dataset_name(spec)


def progress_bar(unit: str = "percent", *, show: bool = True, transient: bool = False) -> Progress:
    """A bar per stage on stderr, counting percent or ``unit``s; ``transient``: gone once done."""
    counter = (
        TaskProgressColumn()
        if unit == "percent"
        else TextColumn(f"{unit} {{task.completed:,.0f}}/{{task.total:,.0f}}")
    )
    columns = (TextColumn("{task.description:<24}"), BarColumn(), counter, TimeElapsedColumn())
    return Progress(*columns, console=err, disable=not show, transient=transient)


def run_flow(
    flow: Flow[..., Result], *, unit: str = "percent", show_progress: bool = True, **parameters: Any
) -> Result:
    """Run a flow in this process against the configured Prefect API (or a temporary one), with a
    progress bar per stage on stderr; Ctrl-C or SIGTERM stops it with one line (``flows.cli.interrupts``)."""
    from flows import progress
    from flows.cli.interrupts import stoppable
    from flows.runtime import prefect_api

    bar = progress_bar(unit, show=show_progress)
    with stoppable(), prefect_api(get_settings()), bar, progress.reporting_to(RichSink(bar)):
        return flow(**parameters)


def classifier_of(loaded: Any) -> Any:
    """The classifier inside a loaded pyfunc (a ``SentimentClassifier``, or a ``FinetunedClassifier``):
    the loader module's model, or (logged before it) the python model's."""
    try:
        return loaded.get_raw_model().classifier
    except (AttributeError, NotImplementedError):
        return loaded.unwrap_python_model().classifier


def probe_of(loaded: Any, uri: str) -> Any:
    """The probe classifier inside a loaded pyfunc, or one line refusing a fine-tuned one: reading a
    sentiment unit (``explain``, ``generate``) needs a probe's weights over the cell's units."""
    classifier = classifier_of(loaded)
    if not hasattr(classifier, "coef_H"):
        raise fail(
            f"{uri} is a fine-tuned classifier: it has no probe over the cell's units, so no sentiment unit "
            "to explain or hold; give a probe's version (`transfer`), or --checkpoint with --unit"
        )
    return classifier


def load_registered(model: str | None) -> tuple[Any, str]:
    """The classifier at MLflow model URI ``model`` (default: the champion) as a served model, read as
    data and built by this package (``tasks/registered.py``), and its URI; or one clear line."""
    from tasks import registered

    try:
        found = registered.resolve(model, get_settings())
        return registered.load(found), found.uri
    except (registered.ModelNotFound, registered.UntrustedModel) as error:
        raise fail(error) from None
