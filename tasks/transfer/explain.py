"""Show the sentiment neuron: a text's per-byte reading as characters, rendered for a terminal (rich),
a PNG heatmap in the style of Radford et al. (2017, Figure 3) and one self-contained HTML file.

Multi-byte UTF-8 characters are one cell carrying the value after their last byte; newlines and tabs
are shown as ``↵`` and ``→`` so they stay visible.

The source is a classifier (the mLSTM and its probe) or a bare mLSTM from a training checkpoint: without
a probe there is no probability, so a reading has ``probability`` None, the PNG has no probability panel,
and ``--sentiment positive|negative`` (which needs the probe's sign) is refused.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.classifier import SentimentClassifier
from models.mlstm import MLSTM
from models.neuron import check_unit, generate, read_bytes
from models.text import FRONT_PAD, encode

VISIBLE = {"\n": "↵", "\t": "→", "\r": "␍"}
PNG_COLUMNS = 64
PNG_MAX_ROWS = 60
# sentiment positive|negative holds the unit at that class's mean on the probe's training features,
# pushed PUSH times as far from the midpoint of the two class means; a classifier saved without the
# means holds it at ±HELD in the direction of the probe's weight instead.
PUSH = 2.0
HELD = 1.0


@dataclass(frozen=True)
class Reading:
    """One cleaned text as characters, with the unit's cell value and P(positive) after each (None
    without a probe)."""

    text: str
    unit: int
    chars: list[str]
    values: np.ndarray
    probability: np.ndarray | None

    @property
    def final(self) -> float | None:
        return None if self.probability is None else float(self.probability[-1])

    def to_json(self) -> dict[str, object]:
        p = self.probability
        return {
            "text": self.text,
            "unit": self.unit,
            "values": [round(float(v), 6) for v in self.values],
            "probability": None if p is None else [round(float(x), 6) for x in p],
            "final": self.final,
        }


def check_text(text: str, *, where: str = "text", max_chars: int | None = None) -> None:
    """A review worth reading: not blank, and within ``max_chars`` (the page holds a cell per character)."""
    if not text.strip():
        raise ValueError(f"{where} is empty or only whitespace: give a review to read")
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"{where} has {len(text):,} characters, more than {max_chars:,} (MLSTM_MAX_TEXT_CHARS): "
            "explain a review, not a book"
        )


def char_ends(data: bytes) -> list[tuple[str, int]]:
    """Each character of UTF-8 ``data`` with the index of its last byte (invalid bytes become U+FFFD)."""
    out: list[tuple[str, int]] = []
    start = 0
    while start < len(data):
        lead = data[start]
        size = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
        size = size if lead >> 3 != 0b11111 else 1
        chunk = data[start : start + size]
        try:
            char = chunk.decode("utf-8")
        except UnicodeDecodeError:
            char, size = "\ufffd", 1
        out.append((char, start + size - 1))
        start += size
    return out


def explain(source: SentimentClassifier | MLSTM, text: str, *, unit: int) -> Reading:
    """Read ``text`` as the classifier does (same cleaning) and keep the unit and probability per character;
    a bare mLSTM (a checkpoint, no probe) gives the unit alone."""
    check_text(text)
    data = encode(text)
    if isinstance(source, SentimentClassifier):
        model, coef_H, intercept = source.model, source.coef_H, source.intercept
    else:
        model, coef_H, intercept = source, None, 0.0
    readings = list(read_bytes(model, data, coef_H, intercept, unit=unit))
    values_T = np.concatenate([r.values_T for r in readings])
    ends = char_ends(data)
    index = np.array([end for _, end in ends])
    probability = None
    if coef_H is not None:
        probability_T = np.concatenate([r.probability_T for r in readings if r.probability_T is not None])
        probability = probability_T[index]
    return Reading(
        text=data.decode("utf-8", errors="replace"),
        unit=unit,
        chars=[c for c, _ in ends],
        values=values_T[index],
        probability=probability,
    )


def describe(reading: Reading) -> str:
    """The line under a reading: its unit and, with a probe, the final probability."""
    if reading.final is None:
        return f"unit {reading.unit} (no probe: no probability)"
    return f"unit {reading.unit} · final P(positive) = {reading.final:.3f}"


def _scale(values: np.ndarray) -> float:
    return float(np.abs(values).max()) or 1.0


def _rgb(value: float, scale: float) -> tuple[int, int, int]:
    """Diverging red (negative) → white (0) → green (positive)."""
    a = max(-1.0, min(1.0, value / scale))
    if a >= 0:
        return (int(255 * (1 - a)), int(255 - 80 * a), int(255 * (1 - a)))
    return (255, int(255 * (1 + a)), int(255 * (1 + a)))


def to_rich(reading: Reading) -> object:
    """A rich ``Text`` of the characters on backgrounds coloured by the unit."""
    from rich.text import Text

    scale, out = _scale(reading.values), Text()
    for char, value in zip(reading.chars, reading.values, strict=True):
        r, g, b = _rgb(float(value), scale)
        out.append(VISIBLE.get(char, char), style=f"black on rgb({r},{g},{b})")
        if char == "\n":
            out.append("\n")
    return out


def to_html(reading: Reading, *, title: str = "sentiment neuron") -> str:
    """One HTML file, no external assets: each character a span coloured by the unit, its value on hover."""
    scale = _scale(reading.values)
    spans = []
    probability = [None] * len(reading.chars) if reading.probability is None else reading.probability
    for char, value, p in zip(reading.chars, reading.values, probability, strict=True):
        r, g, b = _rgb(float(value), scale)
        shown = html.escape(VISIBLE.get(char, char))
        hover = f"{value:.3f}" if p is None else f"{value:.3f} · p={p:.3f}"
        spans.append(
            f'<span style="background:rgb({r},{g},{b})" title="{hover}">{shown}</span>'
            + ("<br>" if char == "\n" else "")
        )
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        "<style>body{font-family:monospace;white-space:pre-wrap;line-height:1.6}</style></head><body>"
        f"<p>{html.escape(describe(reading))}</p><div>{''.join(spans)}</div>"
        "</body></html>\n"
    )


def to_png(
    reading: Reading,
    path: Path,
    *,
    columns: int = PNG_COLUMNS,
    max_rows: int = PNG_MAX_ROWS,
    title: str | None = None,
) -> str | None:
    """The heatmap (text in rows, each cell coloured by the unit, centred at zero, with a colour bar) and,
    beneath, P(positive) after each character (that panel left out without a probe). Returns a note when
    rows were capped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows = -(-len(reading.chars) // columns)
    note = None
    if n_rows > max_rows:
        note = f"the PNG shows the first {max_rows} of {n_rows} rows ({max_rows * columns} characters)"
        n_rows = max_rows
    shown = n_rows * columns
    grid = np.full((n_rows, columns), np.nan)
    flat = reading.values[:shown]
    grid.flat[: len(flat)] = flat
    scale = _scale(reading.values)
    # At least an inch for the grid, so that a short text's colour bar stays readable.
    width, grid_height = columns * 0.16 + 1.5, max(n_rows * 0.28, 1.0)
    ax_p = None
    if reading.probability is None:
        fig, ax = plt.subplots(1, 1, figsize=(width, grid_height + 0.6))
    else:
        fig, (ax, ax_p) = plt.subplots(
            2, 1, figsize=(width, grid_height + 2.2), height_ratios=[grid_height, 1.6]
        )
    image = ax.imshow(grid, cmap="RdYlGn", vmin=-scale, vmax=scale, aspect="auto")
    for i, char in enumerate(reading.chars[:shown]):
        ax.text(
            i % columns,
            i // columns,
            VISIBLE.get(char, char),
            ha="center",
            va="center",
            fontsize=7,
            family="monospace",
        )
    ax.set_xticks([])
    ax.set_yticks([])
    heading = f"{title} · unit {reading.unit}" if title else f"unit {reading.unit}"
    ax.set_title(heading + (f" ({note})" if note else ""), fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01, label="cell value")
    if ax_p is not None and reading.probability is not None:
        ax_p.plot(reading.probability[:shown], color="black", linewidth=1)
        ax_p.axhline(0.5, color="grey", linewidth=0.5, linestyle="--")
        ax_p.set_ylim(0, 1)
        ax_p.set_xlim(0, max(min(shown, len(reading.chars)) - 1, 1))  # the text's end, not the row's
        ax_p.set_ylabel("P(positive)", fontsize=8)
        ax_p.set_xlabel("character", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return note


@dataclass(frozen=True)
class Example:
    """A test review picked to show the neuron: its row, why it was picked, and a file name."""

    index: int
    role: str
    file: str


def pick_examples(
    probability_N: np.ndarray, labels_N: np.ndarray, *, per_side: int = 3, mistakes: int = 2
) -> list[Example]:
    """The test rows to show the unit on: the ``per_side`` most positive and the ``per_side`` most
    negative by the classifier, plus the ``mistakes`` most confidently misclassified (the largest
    |P(positive) − 0.5| among rows the classifier puts on the wrong side) that are not already among them.

    So six to eight rows by default: six when both mistakes are among the extremes (or there are none).
    Ties go in row order; a test set of fewer rows shows each row once.
    """
    p_N, y_N = np.asarray(probability_N, dtype=np.float64), np.asarray(labels_N)
    wrong_N = (p_N >= 0.5) != (y_N == 1)
    order = [int(i) for i in np.argsort(-p_N, kind="stable")]  # most positive first
    picked: list[Example] = []

    def note(i: int) -> str:
        return ", misclassified" if wrong_N[i] else ""

    for rank, i in enumerate(order[:per_side], start=1):
        picked.append(Example(i, f"positive {rank}{note(i)}", f"positive-{rank}.png"))
    taken = {e.index for e in picked}
    for rank, i in enumerate([i for i in order[::-1] if i not in taken][:per_side], start=1):
        picked.append(Example(i, f"negative {rank}{note(i)}", f"negative-{rank}.png"))
    taken = {e.index for e in picked}
    confident = [int(i) for i in np.argsort(-np.abs(p_N - 0.5), kind="stable") if wrong_N[i]][:mistakes]
    for rank, i in enumerate([i for i in confident if i not in taken], start=1):
        scored = "positive" if p_N[i] >= 0.5 else "negative"
        picked.append(Example(i, f"misclassified {rank}, scored {scored}", f"misclassified-{rank}.png"))
    return picked


def class_means(features_NH: np.ndarray, labels_N: np.ndarray) -> np.ndarray:
    """Each unit's mean on the features of each class [2, H]: row 0 the negative class, row 1 the positive
    (a class with no rows: NaN)."""
    X_NH, y_N = np.asarray(features_NH, dtype=np.float64), np.asarray(labels_N)
    rows = [X_NH[y_N == label].mean(axis=0) if (y_N == label).any() else np.full(X_NH.shape[1], np.nan)
            for label in (0, 1)]  # fmt: skip
    return np.stack(rows).astype(np.float32)


def held_value(class_means_2H: np.ndarray, unit: int, sentiment: str, *, push: float = PUSH) -> float:
    """The value to hold the unit at for ``positive``/``negative``: that class's mean of the unit on the
    probe's training features, pushed ``push`` times as far from the midpoint of the two class means; a
    number is that number."""
    if sentiment not in ("positive", "negative"):
        return float(sentiment)
    neg, pos = float(class_means_2H[0, unit]), float(class_means_2H[1, unit])
    mid = (pos + neg) / 2
    target = pos if sentiment == "positive" else neg
    return mid + push * (target - mid)


@dataclass(frozen=True)
class Written:
    """Reviews written by the language model, the classifier's P(positive) of each (None without a probe),
    and the held value."""

    texts: list[str]
    probability: np.ndarray | None
    unit: int | None
    value: float | None
    basis: str | None = None  # how the value was chosen, for positive|negative


def write_reviews(
    source: SentimentClassifier | MLSTM,
    prompt: str,
    *,
    sentiment: str | None,
    unit: int | None,
    length: int,
    temperature: float,
    samples: int,
    seed: int,
) -> Written:
    """``samples`` continuations of ``prompt``; ``sentiment`` positive/negative holds ``unit`` at
    ``held_value`` of the classifier's class means (a classifier saved without them: ±HELD in the
    direction of the probe's weight), a number holds it at that value, None leaves it free.

    A bare mLSTM (a checkpoint) has no probe: no probability, and only a number can be held."""
    classifier = source if isinstance(source, SentimentClassifier) else None
    model = source.model if isinstance(source, SentimentClassifier) else source
    if unit is not None:
        check_unit(model, unit)
    value: float | None = None
    basis: str | None = None
    if sentiment in ("positive", "negative"):
        if classifier is None:
            raise ValueError(
                f"sentiment {sentiment!r} needs a probe (the sign of its weight on the unit), and a "
                "checkpoint has none: give the unit's cell value as a number, e.g. 1.0 or -1.0"
            )
        if unit is None:
            raise ValueError(f"sentiment {sentiment!r} needs a unit to hold")
        means_2H = classifier.class_means_2H
        if means_2H is not None and np.isfinite(means_2H[:, unit]).all():
            value = held_value(means_2H, unit, sentiment)
            basis = (
                f"the {sentiment} class's mean of unit {unit} on the probe's training features "
                f"({means_2H[1 if sentiment == 'positive' else 0, unit]:.3g}; the other class "
                f"{means_2H[0 if sentiment == 'positive' else 1, unit]:.3g}) pushed {PUSH:g}× from their midpoint"
            )
        else:
            sign = 1.0 if classifier.coef_H[unit] >= 0 else -1.0
            value = HELD * sign * (1.0 if sentiment == "positive" else -1.0)
            basis = f"±{HELD:g} in the direction of the probe's weight (this model keeps no class means)"
    elif sentiment is not None:
        value = float(sentiment)
        if not math.isfinite(value):
            raise ValueError(f"sentiment {sentiment!r}: give positive, negative or a finite number")
        if unit is None:
            raise ValueError(f"sentiment {sentiment!r} needs a unit to hold")
    written, _ = generate(
        model,
        (FRONT_PAD + prompt).encode("utf-8"),
        length=length,
        temperature=temperature,
        samples=samples,
        seed=seed,
        unit=unit if value is not None else None,
        value=value,
    )
    texts = [prompt + data.decode("utf-8", errors="replace") for data in written]
    probability = None if classifier is None else classifier.predict_proba(texts)
    return Written(texts, probability, unit, value, basis)
