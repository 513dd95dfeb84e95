"""``mlstm-sentiment explain | generate``: the sentiment neuron of a registered classifier, in the Transfer
panel (the transfer module holds the stage's other commands)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import err, fail, out, user_errors
from tasks.settings import get_settings

if TYPE_CHECKING:
    from models.classifier import SentimentClassifier
    from tasks.transfer.explain import Reading

app = typer.Typer()
PANEL = "Transfer"
ModelOption = Annotated[
    str | None, typer.Option(help="MLflow model URI. [default: models:/<MLSTM_MODEL_NAME>@champion]")
]
UnitOption = Annotated[int | None, typer.Option(help="Cell unit. [default: the probe's top unit]")]


def load_classifier(model: str | None) -> tuple[SentimentClassifier, str]:
    """The classifier behind a registered MLflow model, or one clear line naming the URI."""
    from tasks.tracking import connect

    settings = get_settings()
    connect(settings)
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException

    uri = model or f"models:/{settings.model_name}@champion"
    try:
        loaded = mlflow.pyfunc.load_model(uri)
    except MlflowException as error:
        raise fail(
            f"cannot load {uri} from {settings.resolved_mlflow_tracking_uri}: {error.message}"
        ) from None
    return loaded.unwrap_python_model().classifier, uri


def top_unit(classifier: SentimentClassifier) -> int:
    import numpy as np

    return int(np.argmax(np.abs(classifier.coef_H)))  # as tasks.transfer.probe names the top unit


def read_text_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise fail(f"{path}: not UTF-8 at byte {error.start}") from None
    except OSError as error:
        raise fail(f"{path}: {error.strerror}") from None


def print_reading(reading: Reading) -> None:
    """The terminal view of ``explain`` (and ``predict --explain``): the text coloured by the unit, then
    the final probability."""
    from tasks.transfer.explain import to_rich

    out.print(to_rich(reading))
    out.print(f"unit {reading.unit} · final P(positive) = {reading.final:.3f}")


@app.command(rich_help_panel=PANEL)
def explain(
    texts: Annotated[list[str] | None, typer.Argument(help="Reviews to read (or use --input).")] = None,
    model: ModelOption = None,
    unit: UnitOption = None,
    input: Annotated[Path | None, typer.Option("--input", help="A UTF-8 text file: one review.")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write FILE.png or FILE.html.")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {text, unit, values, probability, final} per text.")
    ] = False,
) -> None:
    """Show a review byte by byte: the unit's cell value and the classifier's probability as it reads."""
    from tasks.transfer.explain import check_text, to_html, to_png
    from tasks.transfer.explain import explain as read

    texts = [*(texts or []), *([read_text_file(input)] if input else [])]
    if not texts:
        raise fail("nothing to explain: give a review as an argument or --input FILE")
    if out_file is not None and out_file.suffix.lower() not in (".png", ".html"):
        raise fail(f"--out {out_file}: give a .png or .html file")
    try:
        for i, text in enumerate(texts):
            check_text(text, where=f"text {i + 1}")
        classifier, _ = load_classifier(model)
        chosen = top_unit(classifier) if unit is None else unit
        readings = [read(classifier, text, unit=chosen) for text in texts]
    except user_errors() as error:
        raise fail(error) from None
    for reading in readings:
        if as_json:
            print(json.dumps(reading.to_json()))
        else:
            print_reading(reading)
    if out_file is not None:
        if out_file.suffix.lower() == ".html":
            out_file.write_text(to_html(readings[0]), encoding="utf-8")
        elif note := to_png(readings[0], out_file):
            err.print(note)
        err.print(f"wrote {out_file}")


@app.command(rich_help_panel=PANEL)
def generate(
    prompt: Annotated[str, typer.Option(help="Text the samples continue.")] = "",
    sentiment: Annotated[
        str | None, typer.Option(help="Hold the unit: positive, negative or a number (its cell value).")
    ] = None,
    unit: UnitOption = None,
    length: Annotated[int, typer.Option(help="Bytes per sample.")] = 200,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.4,
    samples: Annotated[int, typer.Option(help="How many samples.")] = 4,
    seed: Annotated[int, typer.Option(help="Same seed, same samples.")] = 0,
    model: ModelOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {samples: [{text, probability}], unit, value, seed}.")
    ] = False,
) -> None:
    """Write reviews with the language model, optionally with the sentiment unit held fixed."""
    from tasks.transfer.explain import write_reviews

    if length < 1:
        raise fail(f"--length must be at least 1, got {length}")
    if temperature < 0:
        raise fail(f"--temperature must be positive (or 0 for greedy sampling), got {temperature}")
    if samples < 1:
        raise fail(f"--samples must be at least 1, got {samples}")
    if sentiment is not None and sentiment not in ("positive", "negative"):
        try:
            float(sentiment)
        except ValueError:
            raise fail(f"--sentiment {sentiment!r}: give positive, negative or a number") from None
    try:
        classifier, _ = load_classifier(model)
        chosen = top_unit(classifier) if unit is None else unit
        written = write_reviews(
            classifier,
            prompt,
            sentiment=sentiment,
            unit=chosen,
            length=length,
            temperature=temperature,
            samples=samples,
            seed=seed,
        )
        texts, p_N, value = written.texts, written.probability, written.value
    except user_errors() as error:
        raise fail(error) from None
    if as_json:
        rows = [{"text": t, "probability": float(p)} for t, p in zip(texts, p_N, strict=True)]
        print(json.dumps({"samples": rows, "unit": chosen, "value": value, "seed": seed}))
        return
    held = f"unit {chosen} held at {value:g}" if value is not None else f"unit {chosen} free"
    err.print(f"{held} · seed {seed}")
    for text, p in zip(texts, p_N, strict=True):
        color = "green" if p >= 0.5 else "red"
        out.print(f"[{color}]P(positive) = {p:.3f}[/]")
        out.print(text, markup=False, highlight=False)
