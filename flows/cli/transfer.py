"""``mlstm-sentiment transfer | features | predict | import-weights``: from a checkpoint to a classifier."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flows.cli.common import (
    StoreOption,
    check_datasets,
    err,
    fail,
    options_from,
    out,
    parsed,
    run_flow,
    user_errors,
)
from tasks.jobs.config import FEATURES_PRECISION, Precision
from tasks.settings import get_settings
from tasks.transfer.config import TransferParams

if TYPE_CHECKING:
    from tasks.transfer.result import TransferResult


app = typer.Typer()
PANEL = "Transfer"

CheckpointOption = Annotated[
    str, typer.Option(help="Checkpoint URI: a step folder, a run folder or latest.json.")
]
PrecisionOption = Annotated[Precision, typer.Option(help=FEATURES_PRECISION)]


def _feature_bar() -> Progress:
    columns = (
        TextColumn("{task.description:<24}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} texts"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=err)


@app.command(rich_help_panel=PANEL)
def features(
    checkpoint: CheckpointOption,
    input: Annotated[Path, typer.Option("--input", help="A CSV or JSON-lines file (optionally .gz).")],
    output: Annotated[str, typer.Option(help="Arrow file to write: a path or s3://bucket/key.arrow.")],
    text_column: Annotated[str, typer.Option(help="The column holding the text.")] = "text",
    label_column: Annotated[
        str | None, typer.Option(help="A label column, checked to hold 0/1 (every other column is kept too).")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1, help="Texts per batch (similar lengths together). [default: as many as fit memory]"
        ),
    ] = None,
    precision: PrecisionOption = "auto",
    store: StoreOption = None,
) -> None:
    """Write the mLSTM's final cell state for every row of a file (cached in the store)."""
    from tasks.jobs.checkpoint import load_checkpoint
    from tasks.store import store_of
    from tasks.transfer.datasets import other_columns, read_table
    from tasks.transfer.features import FEATURES, cached_features, copy_with_columns

    settings = get_settings(store_uri=store)
    try:
        texts, labels = read_table(input, text_column=text_column, label_column=label_column)
        model = load_checkpoint(checkpoint, endpoint_url=settings.s3_endpoint_url).model()
        target = store_of(settings)
        with _feature_bar() as bar:
            task_id = bar.add_task(f"features {input.name}", total=len(texts))
            found = cached_features(
                target,
                model,
                texts,
                batch_size=batch_size,
                on_batch=lambda rows, _: bar.advance(task_id, rows),
                precision=precision,
            )
        # The input's other columns ride along (labels, ids), so `probe` can read the output alone;
        # the features are copied from the cache chunk by chunk, memory-mapped, never whole.
        columns: dict[str, Any] = dict(other_columns(input, skip=(text_column, FEATURES)))
        if label_column and labels is not None:
            columns[label_column] = labels  # checked 0/1 by read_table
        uri = copy_with_columns(target, found.key, output, columns, endpoint_url=settings.s3_endpoint_url)
    except user_errors() as error:  # DatasetError is a ValueError
        raise fail(error) from None
    state = "from the cache" if found.cached else "computed"
    out.print(f"{found.rows:,} rows × {found.width} features ({state}): {uri}", highlight=False)


@app.command("import-weights", rich_help_panel=PANEL)
def import_weights_command(
    source: Annotated[str, typer.Argument(help="Whose weights: openai (Radford et al. 2017, 4096 units).")],
    folder: Annotated[
        Path, typer.Argument(help="The release's folder: for openai, model/ with 0.npy … 14.npy.")
    ],
    run: Annotated[str | None, typer.Option(help="Run to import into. [default: openai-<H>]")] = None,
    store: StoreOption = None,
) -> None:
    """Import published mLSTM weights as a checkpoint in the store; print its URI."""
    from tasks.transfer.weights import import_weights

    settings = get_settings(store_uri=store)
    try:
        uri = import_weights(
            source, folder, settings.resolved_store_uri, run=run,
            endpoint_url=settings.s3_endpoint_url, max_attempts=settings.s3_max_attempts,
        )  # fmt: skip
    except user_errors() as error:
        raise fail(error) from None
    print(uri)  # stdout holds only the URI: CKPT=$(mlstm-sentiment import-weights openai model/)


def run_transfer(params: TransferParams, *, show_progress: bool = True) -> TransferResult:
    """Probe a checkpoint as a Prefect flow run."""
    from flows.transfer import transfer as transfer_flow

    return run_flow(transfer_flow, show_progress=show_progress, params=params)


# The stage's parameters as flags: each is declared once, in tasks/transfer/config.py.
SETTINGS = ("checkpoint", "datasets", "text_column", "label_column", "batch_size", "c_min_log2", "c_max_log2",
            "register_dataset", "seed", "baseline", "solver", "precision")  # fmt: skip


@app.command(rich_help_panel=PANEL)
@options_from(TransferParams, SETTINGS)
def transfer(
    store: StoreOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {dataset: {test_accuracy, …}} on stdout.")
    ] = False,
    **settings: Any,
) -> None:
    """Fit L1 logistic-regression probes on the mLSTM's features; find the sentiment neuron; register."""
    if store:
        os.environ["MLSTM_STORE_URI"] = store
    params = parsed(TransferParams, settings)
    try:
        check_datasets(params.datasets)
        result = run_transfer(params)
    except user_errors() as error:  # DatasetError is a ValueError
        raise fail(error) from None
    if as_json:
        print(json.dumps({name: values.model_dump() for name, values in result.datasets.items()}))
        return
    _print_transfer(result)


def _print_transfer(result: TransferResult) -> None:
    table = Table(title="L1 logistic regression on the final cell state")
    for column in (
        "dataset",
        "test acc",
        "dev acc",
        "C",
        "non-zero",
        "top unit",
        "its acc",
        "baseline",
        "vs baseline",
        "paper (cited)",
    ):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for report in result.reports:
        paper = report.reference.get("radford_2017_mlstm_4096")
        baseline = report.baseline_accuracy
        table.add_row(
            report.name, f"{report.test_accuracy:.2%}", f"{report.dev_accuracy:.2%}", f"{report.C:g}",
            str(report.nonzero), str(report.top_unit), f"{report.top_unit_accuracy:.2%}",
            f"{baseline:.2%}" if baseline is not None else "-",
            f"{(report.test_accuracy - baseline) * 100:+.2f} pts" if baseline is not None else "-",
            f"{paper:.2%}" if paper else "-",
        )  # fmt: skip
    out.print(table)
    registered = result.registered
    if registered:
        out.print(
            f"registered {registered.name} v{registered.version}: {registered.reason}",
            highlight=False,
        )
        from tasks.transfer.serve import serve_command

        settings = get_settings()
        command = serve_command(
            registered.champion_uri,
            settings.shown_mlflow_tracking_uri,
            registry_uri=settings.resolved_mlflow_registry_uri,
        )
        out.print(f"serve it:  {command}", highlight=False, soft_wrap=True, markup=False)
    out.print(f"MLflow run: {result.run_id}", highlight=False)
