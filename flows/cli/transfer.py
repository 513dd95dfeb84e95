"""``mlstm-sentiment transfer | features | predict | import-weights``: from a checkpoint to a classifier."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flows.cli.common import StoreOption, check_datasets, err, fail, out, run_flow, user_errors
from tasks.settings import get_settings

if TYPE_CHECKING:
    from tasks.transfer.explain import Reading
    from tasks.transfer.stage import TransferParams

app = typer.Typer()
PANEL = "Transfer"

CheckpointOption = Annotated[
    str, typer.Option(help="Checkpoint URI: a step folder, a run folder or latest.json.")
]


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
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per batch (similar lengths together).")] = 64,
    store: StoreOption = None,
) -> None:
    """Write the mLSTM's final cell state for every row of a file (cached in the store)."""
    from tasks.pretrain.checkpoint import load_checkpoint
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


def run_transfer(params: TransferParams, *, show_progress: bool = True) -> dict[str, Any]:
    """Probe a checkpoint as a Prefect flow run."""
    from flows.transfer import transfer as transfer_flow

    return run_flow(transfer_flow, show_progress=show_progress, params=params)


@app.command(rich_help_panel=PANEL)
def transfer(
    checkpoint: CheckpointOption,
    dataset: Annotated[
        list[str],
        typer.Option(
            help="NAME=PATH, repeatable: SST (folder), IMDB (aclImdb folder, tarball or CSV), a table."
        ),
    ],
    text_column: Annotated[str | None, typer.Option(help="Text column of CSV/JSONL tables.")] = None,
    label_column: Annotated[str | None, typer.Option(help="Label column of CSV/JSONL tables.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per feature batch.")] = 64,
    c_min_log2: Annotated[int, typer.Option(help="Smallest C of the sweep, as a power of 2.")] = -8,
    c_max_log2: Annotated[int, typer.Option(help="Largest C of the sweep, as a power of 2.")] = 2,
    register: Annotated[
        str | None,
        typer.Option(help="Dataset whose classifier is registered. [default: the first; none: none]"),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the probe's solver.")] = 0,
    solver: Annotated[
        str, typer.Option(help="Probe solver: newton (fast), liblinear (the reference) or torch.")
    ] = "newton",
    store: StoreOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {dataset: {test_accuracy, …}} on stdout.")
    ] = False,
) -> None:
    """Fit L1 logistic-regression probes on the mLSTM's features; find the sentiment neuron; register."""
    from pydantic import ValidationError

    from tasks.pretrain.stage import flag_errors
    from tasks.transfer.stage import TransferParams

    if store:
        os.environ["MLSTM_STORE_URI"] = store
    try:
        params = TransferParams(
            checkpoint=checkpoint, datasets=dataset, text_column=text_column, label_column=label_column,
            batch_size=batch_size, c_min_log2=c_min_log2, c_max_log2=c_max_log2, register_dataset=register, seed=seed, solver=solver,
        )  # fmt: skip
        check_datasets(params.datasets)
        result = run_transfer(params)
    except ValidationError as error:
        raise fail(flag_errors(error)) from None
    except user_errors() as error:  # DatasetError is a ValueError
        raise fail(error) from None
    if as_json:
        print(json.dumps(result["datasets"]))
        return
    _print_transfer(result)


def _print_transfer(result: dict[str, Any]) -> None:
    table = Table(title="L1 logistic regression on the final cell state")
    for column in (
        "dataset",
        "test acc",
        "dev acc",
        "C",
        "non-zero",
        "top unit",
        "its acc",
        "paper",
        "TF-IDF",
    ):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for report in result["reports"]:
        reference = report.get("reference", {})
        paper, tfidf = reference.get("radford_2017_mlstm_4096"), reference.get("tfidf_word_char_logreg")
        table.add_row(
            report["name"], f"{report['test_accuracy']:.2%}", f"{report['dev_accuracy']:.2%}", f"{report['C']:g}",
            str(report["nonzero"]), str(report["top_unit"]), f"{report['top_unit_accuracy']:.2%}",
            f"{paper:.2%}" if paper else "-", f"{tfidf:.2%}" if tfidf else "-",
        )  # fmt: skip
    out.print(table)
    registered = result.get("registered")
    if registered:
        out.print(
            f"registered {registered['name']} v{registered['version']}: {registered['reason']}",
            highlight=False,
        )
        from tasks.transfer.serve import serve_command

        settings = get_settings()
        command = serve_command(
            registered["champion_uri"],
            settings.resolved_mlflow_tracking_uri,
            registry_uri=settings.resolved_mlflow_registry_uri,
        )
        out.print(f"serve it:  {command}", highlight=False, soft_wrap=True, markup=False)
    out.print(f"MLflow run: {result['run_id']}", highlight=False)


def _explained(loaded: Any, texts: list[str], unit: int | None) -> list[Reading]:
    """The texts read byte by byte by the served model's own classifier (the served model is unchanged)."""
    from flows.cli.neuron import top_unit
    from tasks.transfer.explain import explain

    classifier = loaded.unwrap_python_model().classifier
    chosen = top_unit(classifier) if unit is None else unit
    return [explain(classifier, text, unit=chosen) for text in texts]


@app.command(rich_help_panel=PANEL)
def predict(
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to score (or use --input).")] = None,
    model: Annotated[
        str | None, typer.Option(help="MLflow model URI. [default: models:/<MLSTM_MODEL_NAME>@champion]")
    ] = None,
    input: Annotated[Path | None, typer.Option("--input", help="A CSV or JSON-lines file of texts.")] = None,
    text_column: Annotated[str, typer.Option(help="The text column of --input.")] = "text",
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per batch.")] = 64,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON lines {text, label, probability}.")
    ] = False,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Also show each text byte by byte as `explain` does (with --json: an `explain` key).",
        ),
    ] = False,
    unit: Annotated[
        int | None, typer.Option(help="With --explain: the cell unit. [default: the top unit]")
    ] = None,
) -> None:
    """Score texts with a registered classifier (the champion by default)."""
    from tasks.tracking import connect
    from tasks.transfer.datasets import read_table

    settings = get_settings()
    try:
        for position, text in enumerate(texts or [], start=1):
            # An empty text has nothing to score, yet the model would still give it a probability.
            if not text.strip():
                raise fail(f"text {position} of the arguments is empty; give each text some words")
        if input is not None:
            # read_table names the file, line and column of an empty or non-string text.
            texts = [*(texts or []), *read_table(input, text_column=text_column)[0]]
        if not texts:
            raise fail("nothing to score: give texts as arguments or --input FILE")
        connect(settings)
        import mlflow.pyfunc
        import pandas as pd
        from mlflow.exceptions import MlflowException

        uri = model or f"models:/{settings.model_name}@champion"
        try:
            classifier = mlflow.pyfunc.load_model(uri)
        except MlflowException as error:
            raise fail(
                f"cannot load {uri} from {settings.resolved_mlflow_tracking_uri}: {error.message}"
            ) from None
        from models.serving import TextRejected

        try:
            predicted = classifier.predict(pd.DataFrame({"text": texts}), params={"batch_size": batch_size})
        except TextRejected as error:  # the model's own rule, as served: rows count arguments, then --input
            raise fail(f"{uri} refuses {error.message}") from None
        readings = _explained(classifier, texts, unit) if explain else []
    except user_errors() as error:  # DatasetError is a ValueError
        raise fail(error) from None
    rows = zip(texts, predicted["label"], predicted["probability"], strict=True)
    if as_json:
        for i, (text, label, probability) in enumerate(rows):
            line = {"text": text, "label": label, "probability": float(probability)}
            print(json.dumps(line | ({"explain": readings[i].to_json()} if readings else {})))
        return

    table = Table(title=uri)
    for column, justify in (("label", "left"), ("P(positive)", "right"), ("text", "left")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for text, label, probability in rows:
        color = "green" if label == "positive" else "red"
        table.add_row(f"[{color}]{label}[/]", f"{probability:.3f}", text[:200])
    out.print(table)
    if readings:
        from flows.cli.neuron import print_reading

        for reading in readings:  # the same view as `mlstm-sentiment explain`
            print_reading(reading)
