"""``mlstm-sentiment predict``: score texts with a registered classifier, optionally byte by byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from flows.cli.common import fail, load_registered, out, probe_of, styled, user_errors
from flows.cli.transfer import PrecisionOption

if TYPE_CHECKING:
    from tasks.transfer.explain import Reading

app = typer.Typer()
PANEL = "Transfer"


def _explained(classifier: Any, texts: list[str], unit: int | None) -> list[Reading]:
    """The texts read byte by byte by the served model's own probe (the served model is unchanged)."""
    from flows.cli.neuron import top_unit
    from tasks.transfer.explain import explain

    chosen = top_unit(classifier) if unit is None else unit
    return [explain(classifier, text, unit=chosen) for text in texts]


def _predicted(loaded: Any, texts: list[str], params: dict[str, Any]) -> Any:
    """The served model's answer for ``texts`` with ``params``, with the checks it makes when served.
    The project calls the model itself (``load_registered``), so a parameter the logged signature lacks
    (``precision``, for a model logged before it was one) is honoured, not dropped as MLflow would."""
    import pandas as pd

    return loaded.predict(pd.DataFrame({"text": texts}), params=params)


@app.command(rich_help_panel=PANEL)
def predict(
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to score (or use --input).")] = None,
    model: Annotated[
        str | None, typer.Option(help="MLflow model URI. [default: models:/<MLSTM_MODEL_NAME>@champion]")
    ] = None,
    input: Annotated[Path | None, typer.Option("--input", help="A CSV or JSON-lines file of texts.")] = None,
    text_column: Annotated[str, typer.Option(help="The text column of --input.")] = "text",
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per batch.")] = 64,
    precision: PrecisionOption = "auto",
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
    from tasks.transfer.datasets import read_table

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
        classifier, uri = load_registered(model)
        # A model that can't be explained (a fine-tuned one) is refused before any text is scored.
        probe = probe_of(classifier, uri) if explain else None
        from models.serving import TextRejected

        try:
            params = {"batch_size": batch_size} | ({"precision": precision} if precision != "auto" else {})
            predicted = _predicted(classifier, texts, params)
        except TextRejected as error:  # the model's own rule, as served: rows count arguments, then --input
            raise fail(f"{uri} refuses {error.message}") from None
        readings = _explained(probe, texts, unit) if probe is not None else []
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
        table.add_row(styled(label, color), f"{probability:.3f}", text[:200])
    out.print(table)
    if readings:
        from flows.cli.neuron import print_reading

        for reading in readings:  # the same view as `mlstm-sentiment explain`
            print_reading(reading)
