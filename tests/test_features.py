"""Feature batches: sized by memory, bucketed by length so padding stays small, and padding never
changes a feature."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.features import MAX_PADDING, featurize, length_batches, rows_for_memory
from models.mlstm import MLSTM, MLSTMConfig, tiny


def test_length_batches_keep_padding_under_its_bound_and_cover_every_text_once() -> None:
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.lognormal(6.5, 0.8, 3000).astype(int) + 2, [2, 2, 5000]])  # review-like
    batches = list(length_batches(lengths.tolist(), 256))
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    held = sum(len(rows) * lengths[rows].max() for rows in batches)
    assert (held - lengths.sum()) / held < MAX_PADDING
    for rows in batches:
        assert 1 <= len(rows) <= 256
        width = lengths[rows].max()
        assert len(rows) * width - lengths[rows].sum() <= MAX_PADDING * len(rows) * width
    assert np.mean([len(rows) for rows in batches]) > 50  # bucketing, not one text per batch


def test_without_a_padding_bound_batches_are_full() -> None:
    assert [len(rows) for rows in length_batches([1, 100, 3, 50, 7], 2, max_padding=1.0)] == [2, 2, 1]


def test_rows_for_memory_fill_a_budget_and_stay_bounded() -> None:
    rows = rows_for_memory(MLSTM(tiny()), torch.device("cpu"))
    assert 1 <= rows <= 4096
    assert rows_for_memory(MLSTM(MLSTMConfig(hidden_size=4096)), torch.device("cpu")) < rows


def test_padding_never_changes_a_feature() -> None:
    torch.manual_seed(0)
    model = MLSTM(tiny())
    rng = np.random.default_rng(1)
    texts = ["".join(rng.choice(list("abc de!"), size=n)) for n in [1, 3, 40, 41, 300, 7, 7, 90, 600, 12]]
    alone = featurize(model, texts, batch_size=1)
    for batch_size, max_padding in ((None, MAX_PADDING), (4, 0.0), (10, 0.99)):
        together = featurize(model, texts, batch_size=batch_size, max_padding=max_padding)
        np.testing.assert_allclose(
            together, alone, rtol=1e-5, atol=1e-6, err_msg=f"{batch_size}, {max_padding}"
        )


def test_bad_padding_bound_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"max_padding must be at least 0 and below 1, got 1\.5"):
        featurize(MLSTM(tiny()), ["a"], max_padding=1.5)


def test_rows_for_memory_follow_the_bytes_given() -> None:
    model = MLSTM(tiny())
    cpu = torch.device("cpu")
    rows = rows_for_memory(model, cpu, memory_bytes=2**28)
    assert rows_for_memory(model, cpu) == rows_for_memory(model, cpu, memory_bytes=2**29)
    assert rows_for_memory(model, cpu, memory_bytes=2**26) == rows // 4
    assert rows_for_memory(model, cpu, memory_bytes=1) == 1
