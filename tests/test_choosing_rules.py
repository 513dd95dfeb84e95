"""Rules that pick one of several candidates, each tested where candidates compete and its answer differs
from a naive one (the first, the last, the highest on test). The others are tested beside their stage
(tests/README.md): ASHA's promotion, the probe's and the baseline's C, dedupe, the champion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from models.classifier import top_unit
from tasks.finetune.train import Trainer, pick_threshold


def test_the_fine_tuned_run_hands_on_the_epoch_best_on_dev_the_earliest_of_equals() -> None:
    # Dev peaks at epochs 2 and 3 (a tie) and falls after; test, never consulted, is highest at epoch 4.
    epochs = [
        {"epoch": 1, "dev_accuracy": 0.61, "test_accuracy": 0.60},
        {"epoch": 2, "dev_accuracy": 0.68, "test_accuracy": 0.62},
        {"epoch": 3, "dev_accuracy": 0.68, "test_accuracy": 0.66},
        {"epoch": 4, "dev_accuracy": 0.64, "test_accuracy": 0.70},
    ]
    assert Trainer.best_epoch(SimpleNamespace(epochs=epochs))["epoch"] == 2  # type: ignore[arg-type]


def test_the_threshold_is_the_dev_best_and_of_equals_the_nearest_to_even_odds() -> None:
    # Logits all above 0: at P = 0.5 (τ = 0) every text is positive, 3 of 6 right. Cutting between 1.5
    # and 2.5 gets all six; so does any τ in (1.5, 2.5): of the equal candidates, the one nearest 0.
    z_N = np.array([0.5, 1.0, 1.5, 2.5, 3.0, 3.5])
    y_N = np.array([0, 0, 0, 1, 1, 1])
    threshold, accuracy = pick_threshold(z_N, y_N)
    assert (threshold, accuracy) == (2.0, 1.0)
    # Two cuts score alike (4 of 6), the first in the candidates' order farther from 0: between -3.5 and
    # -3.0 (τ -3.25) and between -1.0 and -0.5 (τ -0.75); at τ = 0, 3 of 6.
    z_N = np.array([-3.5, -3.0, -2.5, -1.5, -1.0, -0.5])
    y_N = np.array([0, 1, 1, 0, 0, 1])
    threshold, accuracy = pick_threshold(z_N, y_N)
    assert accuracy == 4 / 6 and threshold == -0.75


def test_the_sentiment_unit_is_the_largest_weight_in_magnitude_the_first_of_a_tie() -> None:
    # The largest weight is positive (unit 2), the largest in magnitude negative and tied with it.
    assert top_unit(np.array([0.5, -2.0, 2.0, 1.0])) == 1
    assert top_unit(np.array([0.5, -3.0, 2.0, 1.0])) == 1
