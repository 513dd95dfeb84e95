"""``mlstm-sentiment explain | generate``: the sentiment neuron of a registered classifier, or a unit of a
training checkpoint (no probe), in the Transfer panel (the transfer module holds the stage's other
commands)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import err, fail, load_registered, out, probe_of, styled, user_errors
from tasks.settings import get_settings

if TYPE_CHECKING:
    from models.classifier import SentimentClassifier
    from models.mlstm import MLSTM
    from tasks.transfer.explain import Reading

app = typer.Typer()
PANEL = "Transfer"
ModelOption = Annotated[
    str | None, typer.Option(help="MLflow model URI. [default: models:/<MLSTM_MODEL_NAME>@champion]")
]
CheckpointOption = Annotated[
    str | None,
    typer.Option(
        help="A training checkpoint instead of --model: a run folder, a step folder or newest. It has no "
        "probe: no probability, and --unit is needed to name a unit."
    ),
]
UnitOption = Annotated[
    int | None, typer.Option(help="Cell unit. [default: the probe's top unit; required with --checkpoint]")
]


def load_classifier(model: str | None) -> tuple[SentimentClassifier, str]:
    """The classifier behind a registered MLflow model, or one clear line naming the URI."""
    loaded, uri = load_registered(model)
    return probe_of(loaded, uri), uri


def check_source(model: str | None, checkpoint: str | None) -> None:
    if model is not None and checkpoint is not None:
        raise fail("give --model (a registered classifier) or --checkpoint (a training checkpoint), not both")


def load_source(model: str | None, checkpoint: str | None) -> SentimentClassifier | MLSTM:
    """The registered classifier, or the bare mLSTM of a checkpoint (loaded as `features --checkpoint`
    loads it: a run folder whose newest step is damaged falls back to its newest intact step)."""
    if checkpoint is None:
        return load_classifier(model)[0]
    from tasks.transfer.stage import load_checkpoint_of

    return load_checkpoint_of(checkpoint, get_settings()).model()


def top_unit(classifier: SentimentClassifier) -> int:
    from models.classifier import top_unit as unit_of

    return unit_of(classifier.coef_H)


def read_text_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise fail(f"{path}: not UTF-8 at byte {error.start}") from None
    except OSError as error:
        raise fail(f"{path}: {error.strerror}") from None


def print_reading(reading: Reading) -> None:
    """The terminal view of ``explain`` (and ``predict --explain``): the text coloured by the unit, then
    the final probability (when there is a probe)."""
    from tasks.transfer.explain import describe, to_rich

    out.print(to_rich(reading))
    out.print(describe(reading))


@app.command(rich_help_panel=PANEL)
def explain(
    texts: Annotated[list[str] | None, typer.Argument(help="Reviews to read (or use --input).")] = None,
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    unit: UnitOption = None,
    input: Annotated[Path | None, typer.Option("--input", help="A UTF-8 text file: one review.")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write FILE.png or FILE.html.")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {text, unit, values, probability, final} per text.")
    ] = False,
) -> None:
    """Show a review byte by byte: the unit's cell value and the classifier's probability as it reads."""
    from models.classifier import SentimentClassifier
    from tasks.transfer.explain import check_text, to_html, to_png
    from tasks.transfer.explain import explain as read

    check_source(model, checkpoint)
    if checkpoint is not None and unit is None:
        raise fail("--unit N is required with --checkpoint: a checkpoint has no probe to name its top unit")
    texts = [*(texts or []), *([read_text_file(input)] if input else [])]
    if not texts:
        raise fail("nothing to explain: give a review as an argument or --input FILE")
    if out_file is not None and out_file.suffix.lower() not in (".png", ".html"):
        raise fail(f"--out {out_file}: give a .png or .html file")
    if out_file is not None and not out_file.parent.is_dir():
        raise fail(f"--out {out_file}: the folder {out_file.parent} does not exist")
    try:
        for i, text in enumerate(texts):
            check_text(text, where=f"text {i + 1}", max_chars=get_settings().max_text_chars)
        source = load_source(model, checkpoint)
        chosen = top_unit(source) if unit is None and isinstance(source, SentimentClassifier) else unit
        assert chosen is not None  # checked above: a checkpoint comes with --unit
        readings = [read(source, text, unit=chosen) for text in texts]
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


# A cell value the unit is held at: tanh saturates long before, and beyond it the recurrence overflows.
MAX_HELD_VALUE = 1e3


@app.command(rich_help_panel=PANEL)
def generate(
    prompt: Annotated[str, typer.Option(help="Text the samples continue.")] = "",
    sentiment: Annotated[
        str | None,
        typer.Option(
            help="Hold the unit: positive or negative (that class's mean of the unit on the probe's training "
            "features, pushed 2× from the midpoint of the two class means) or a number (its cell value)."
        ),
    ] = None,
    unit: UnitOption = None,
    length: Annotated[int, typer.Option(min=1, max=100_000, help="Bytes per sample.")] = 200,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.4,
    samples: Annotated[int, typer.Option(min=1, max=1000, help="How many samples.")] = 4,
    seed: Annotated[int, typer.Option(help="Same seed, same samples.")] = 0,
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {samples: [{text, probability}], unit, value, seed}.")
    ] = False,
) -> None:
    """Write reviews with the language model, optionally with the sentiment unit held fixed."""
    from models.classifier import SentimentClassifier
    from tasks.transfer.explain import write_reviews

    check_source(model, checkpoint)

    if not math.isfinite(temperature) or temperature < 0:
        raise fail(f"--temperature must be positive (or 0 for greedy sampling), got {temperature}")
    if sentiment is not None and sentiment not in ("positive", "negative"):
        try:
            within = abs(float(sentiment)) <= MAX_HELD_VALUE
        except ValueError:
            within = False
        if not within:
            raise fail(
                f"--sentiment {sentiment!r}: give positive, negative or a cell value within ±{MAX_HELD_VALUE:g}"
            ) from None
    if checkpoint is not None and sentiment in ("positive", "negative"):
        raise fail(
            f"--sentiment {sentiment} needs a probe (a registered --model), and a checkpoint has none: "
            "give the unit's cell value as a number, e.g. --sentiment 1.0 --unit N"
        )
    if checkpoint is not None and sentiment is not None and unit is None:
        raise fail(f"--sentiment {sentiment} with --checkpoint needs --unit N: a checkpoint has no top unit")
    try:
        source = load_source(model, checkpoint)
        chosen = top_unit(source) if unit is None and isinstance(source, SentimentClassifier) else unit
        written = write_reviews(
            source,
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
    if written.basis:
        err.print(f"{sentiment}: {written.basis}", highlight=False)
    probabilities = [None if p_N is None else float(p_N[i]) for i in range(len(texts))]
    if as_json:
        rows = [{"text": t, "probability": p} for t, p in zip(texts, probabilities, strict=True)]
        print(json.dumps({"samples": rows, "unit": chosen, "value": value, "seed": seed}))
        return
    held = f"unit {chosen} held at {value:g}" if value is not None else f"unit {chosen} free"
    err.print(f"{held if chosen is not None else 'no unit held'} · seed {seed}")
    for text, p in zip(texts, probabilities, strict=True):
        if p is not None:  # a checkpoint has no probe to score what it wrote
            out.print(styled(f"P(positive) = {p:.3f}", "green" if p >= 0.5 else "red"))
        out.print(text, markup=False, highlight=False)
