"""The sentiment neuron: per-byte readings agree with the features path, generation holds the unit,
and the renderings show every character of the text."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from models.classifier import SentimentClassifier
from models.features import featurize
from models.mlstm import MLSTM, tiny
from models.neuron import generate, read_bytes
from models.text import FRONT_PAD, encode
from tasks.transfer.explain import (
    char_ends,
    class_means,
    explain,
    held_value,
    pick_examples,
    to_html,
    to_png,
    write_reviews,
)

TEXTS = ["Great blender, works perfectly.", "Broke after a week.\tNever again — awful", "café ☕ ok"]


@pytest.fixture
def classifier() -> SentimentClassifier:
    torch.manual_seed(0)
    model = MLSTM(tiny())
    coef_H = np.random.default_rng(0).normal(size=model.config.hidden_size).astype(np.float32)
    return SentimentClassifier(model=model, coef_H=coef_H, intercept=0.1)


def test_last_value_and_probability_equal_the_features_path(classifier: SentimentClassifier) -> None:
    features_NH = featurize(classifier.model, TEXTS)
    p_N = classifier.predict_proba(TEXTS)
    for text, feature_H, p in zip(TEXTS, features_NH, p_N, strict=True):
        for unit in (0, 17):
            reading = explain(classifier, text, unit=unit)
            assert reading.values[-1] == pytest.approx(feature_H[unit], abs=1e-5)
            assert reading.final == pytest.approx(p, abs=1e-5)


def test_streamed_chunks_match_one_pass(classifier: SentimentClassifier) -> None:
    data = encode(TEXTS[1] * 5)
    args = (classifier.model, data, classifier.coef_H, classifier.intercept)
    whole = np.concatenate([r.values_T for r in read_bytes(*args, unit=3)])
    chunked = np.concatenate([r.values_T for r in read_bytes(*args, unit=3, chunk_len=7)])
    np.testing.assert_allclose(whole, chunked, atol=1e-6)
    assert len(whole) == len(data)


def test_multibyte_characters_are_one_cell() -> None:
    ends = char_ends("a☕é".encode())
    assert ends == [("a", 0), ("☕", 3), ("é", 5)]
    assert char_ends(b"a\xffb")[1][0] == "\ufffd"


def test_bad_input_names_the_problem(classifier: SentimentClassifier) -> None:
    with pytest.raises(ValueError, match="empty or only whitespace"):
        explain(classifier, " \n\t ", unit=0)
    with pytest.raises(ValueError, match="outside the model's 64 units"):
        explain(classifier, "fine", unit=64)
    for kwargs, message in (
        ({"length": 0}, "length must be at least 1"),
        ({"temperature": -1.0}, "0 \\(greedy\\) or positive"),
    ):
        args = {"length": 5, "temperature": 0.4, "samples": 1, "seed": 0} | kwargs
        with pytest.raises(ValueError, match=message):
            generate(classifier.model, FRONT_PAD.encode(), **args)  # type: ignore[arg-type]


def test_held_unit_is_the_value_at_every_step_and_seeds_reproduce(classifier: SentimentClassifier) -> None:
    prompt = FRONT_PAD.encode()
    kwargs = {"length": 40, "temperature": 1.0, "samples": 3, "unit": 5, "value": 2.5}
    texts, held = generate(classifier.model, prompt, seed=1, **kwargs)  # type: ignore[arg-type]
    assert np.all(held == np.float32(2.5))
    again, _ = generate(classifier.model, prompt, seed=1, **kwargs)  # type: ignore[arg-type]
    other, _ = generate(classifier.model, prompt, seed=2, **kwargs)  # type: ignore[arg-type]
    assert texts == again and texts != other
    free, _ = generate(classifier.model, prompt, seed=1, length=40, temperature=1.0, samples=3)
    assert free != texts  # holding the unit changes what is written
    greedy, _ = generate(classifier.model, prompt, seed=0, length=10, temperature=0, samples=2)
    assert greedy[0] == greedy[1]


def test_held_value_pushes_class_means_apart() -> None:
    features = np.array([[1.0, 0.0], [3.0, 0.0], [-1.0, 5.0], [-3.0, 5.0]])
    labels = np.array([1, 1, 0, 0])
    means = class_means(features, labels)
    np.testing.assert_allclose(means, [[-2.0, 5.0], [2.0, 0.0]])  # row 0 negative, row 1 positive
    assert held_value(means, 0, "positive") == pytest.approx(4.0)
    assert held_value(means, 0, "negative") == pytest.approx(-4.0)
    assert held_value(means, 1, "positive") == pytest.approx(-2.5)  # the unit's own classes decide
    assert held_value(means, 0, "1.5") == 1.5


def test_class_means_are_saved_with_the_classifier(classifier: SentimentClassifier, tmp_path: Path) -> None:
    means = np.arange(128, dtype=np.float32).reshape(2, 64)
    kept = SentimentClassifier(classifier.model, classifier.coef_H, classifier.intercept, {}, means)
    loaded = SentimentClassifier.load(kept.save(tmp_path / "kept"))
    np.testing.assert_array_equal(loaded.class_means_2H, means)
    assert SentimentClassifier.load(classifier.save(tmp_path / "older")).class_means_2H is None


def test_html_holds_every_character_once_escaped(classifier: SentimentClassifier) -> None:
    text = "Loved it <script>alert(1)</script> & more ☕"
    page = to_html(explain(classifier, text, unit=0))
    assert "<script" not in page and "&lt;" in page
    shown = [html.unescape(c) for c in re.findall(r'<span style="background[^>]*>([^<]*)</span>', page)]
    assert "".join(shown) == "↵ " + text + " "  # each character once, in order; the newline made visible
    assert "src=" not in page and "href=" not in page  # no external assets


def test_png_is_an_image_that_grows_with_rows(classifier: SentimentClassifier, tmp_path: Path) -> None:
    from PIL import Image

    heights = []
    for n, name in ((1, "short.png"), (6, "long.png")):
        path = tmp_path / name
        assert to_png(explain(classifier, "A decent kettle. " * 4 * n, unit=0), path) is None
        with Image.open(path) as image:
            heights.append(image.size[1])
    assert heights[1] > heights[0]
    note = to_png(explain(classifier, "x" * 500, unit=0), tmp_path / "capped.png", columns=10, max_rows=5)
    assert note is not None and "first 5 of 51 rows" in note


def test_the_examples_are_the_extremes_plus_the_most_confident_mistakes() -> None:
    #            0     1     2     3     4     5     6     7     8     9
    p = np.array([0.99, 0.97, 0.95, 0.90, 0.70, 0.40, 0.20, 0.05, 0.03, 0.01])
    y = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0])  # 4: a false positive (0.70); 5: a false negative (0.40)
    picked = {e.role: e.index for e in pick_examples(p, y)}
    assert picked == {
        "positive 1": 0,
        "positive 2": 1,
        "positive 3": 2,
        "negative 1": 9,
        "negative 2": 8,
        "negative 3": 7,
        "misclassified 1, scored positive": 4,  # |0.70 - 0.5| = 0.2: the more confident mistake first
        "misclassified 2, scored negative": 5,
    }
    assert len({e.file for e in pick_examples(p, y)}) == 8
    # The two most confident mistakes, whichever side: three false positives, the two surest shown.
    y2 = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    assert [e.index for e in pick_examples(p, y2)][6:] == [3, 4]
    # A mistake already among the extremes is marked there and not shown twice: six or seven rows.
    y3 = np.array([0, 1, 1, 1, 1, 1, 0, 0, 0, 1])
    roles = [e.role for e in pick_examples(p, y3)]
    assert roles[0] == "positive 1, misclassified" and roles[3] == "negative 1, misclassified"
    assert len(roles) == 6
    assert len(pick_examples(p, np.array([1] * 5 + [0] * 5))) == 6  # no mistakes: the six extremes
    assert sorted(e.index for e in pick_examples(p[:4], y[:4])) == [0, 1, 2, 3]  # fewer rows: each once


def test_write_reviews_holds_the_unit_in_the_probes_direction(classifier: SentimentClassifier) -> None:
    unit = int(np.argmax(np.abs(classifier.coef_H)))
    sign = float(np.sign(classifier.coef_H[unit]))
    kwargs = {"unit": unit, "length": 12, "temperature": 0.4, "samples": 2, "seed": 3}
    positive = write_reviews(classifier, "It", sentiment="positive", **kwargs)  # type: ignore[arg-type]
    negative = write_reviews(classifier, "It", sentiment="negative", **kwargs)  # type: ignore[arg-type]
    assert (positive.value, negative.value) == (sign, -sign)  # no class means kept: ±1 the probe's way
    # With the class means of the probe's training features: each class's mean pushed 2× from the middle.
    means = np.zeros((2, 64), dtype=np.float32)
    means[:, unit] = (-3.0, 1.0)
    kept = SentimentClassifier(classifier.model, classifier.coef_H, classifier.intercept, {}, means)
    held = [write_reviews(kept, "It", sentiment=s, **kwargs).value for s in ("positive", "negative")]  # type: ignore[arg-type]
    assert held == [pytest.approx(3.0), pytest.approx(-5.0)]
    assert all(t.startswith("It") for t in positive.texts) and len(positive.probability) == 2
    # What the benchmark reports is the classifier's own P of each written text.
    np.testing.assert_allclose(positive.probability, classifier.predict_proba(positive.texts))
    with pytest.raises(ValueError, match="outside the model's 64 units"):
        write_reviews(classifier, "", sentiment="positive", **(kwargs | {"unit": 64}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite number"):
        write_reviews(classifier, "", sentiment="nan", **kwargs)  # type: ignore[arg-type]


def test_a_bare_model_reads_and_writes_without_a_probe(
    classifier: SentimentClassifier, tmp_path: Path
) -> None:
    from PIL import Image

    model, text = classifier.model, TEXTS[1]
    reading = explain(model, text, unit=17)
    assert reading.probability is None and reading.final is None
    assert reading.to_json()["probability"] is None and reading.to_json()["final"] is None
    np.testing.assert_allclose(reading.values, explain(classifier, text, unit=17).values)
    assert "no probability" in to_html(reading) and "p=" not in to_html(reading)
    heights = []
    for source, name in ((classifier, "probe.png"), (model, "bare.png")):
        to_png(explain(source, text, unit=17), tmp_path / name)
        with Image.open(tmp_path / name) as image:
            heights.append(image.size[1])
    assert heights[1] < heights[0]  # the probability panel is left out

    kwargs = {"length": 12, "temperature": 0.4, "samples": 2, "seed": 3}
    held = write_reviews(model, "It", sentiment="1.5", unit=4, **kwargs)  # type: ignore[arg-type]
    assert held.probability is None and held.value == 1.5
    assert held.texts == write_reviews(classifier, "It", sentiment="1.5", unit=4, **kwargs).texts  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a probe"):
        write_reviews(model, "It", sentiment="positive", unit=4, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a unit to hold"):
        write_reviews(model, "It", sentiment="1.5", unit=None, **kwargs)  # type: ignore[arg-type]
