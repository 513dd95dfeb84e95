"""Feature batches: sized by memory; texts packed end to end (the fused path) or bucketed by length so
padding stays small (the reference path); neither packing nor padding changes a feature."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import models.precision
from models.features import CHUNK_LEN, MAX_PADDING, featurize, length_batches, pack, rows_for_memory
from models.mlstm import MLSTM, MLSTMConfig, tiny
from models.text import encode


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


def test_packing_reads_every_byte_once_in_wide_steps() -> None:
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.lognormal(6.5, 0.8, 3000).astype(int) + 2, [2, 2, 5000]])  # review-like
    packing = pack(lengths.tolist(), 256)
    S = len(packing.row_steps_S)
    assert S == 256 and (np.diff(packing.row_steps_S) <= 0).all()  # longest first: the reading rows a prefix
    # In each row the texts follow one another without a gap or an overlap, from step 0 to the row's end.
    for s in range(S):
        mine = np.flatnonzero(packing.row_N == s)
        mine = mine[np.argsort(packing.start_N[mine])]
        ends = packing.start_N[mine] + lengths[mine]
        assert packing.start_N[mine][0] == 0 and (packing.start_N[mine][1:] == ends[:-1]).all()
        assert ends[-1] == packing.row_steps_S[s]
    # Steps: the longest text, or the bytes over the rows and one more text; a length-sorted batch
    # would run its longest text's length for every batch.
    assert packing.steps <= max(lengths.max(), lengths.sum() / S + lengths.max())
    assert packing.steps < 1.05 * max(lengths.max(), lengths.sum() / S)
    reading = packing.reading(0, packing.steps)
    assert sum(reading) == lengths.sum() and reading[0] == S
    assert pack([3, 1], 8).row_steps_S.tolist() == [3, 1]  # no more rows than texts
    assert pack([9, 3, 3, 3, 1, 1, 1, 1], 8).row_steps_S.tolist() == [9, 7, 6]  # nor than can be kept full
    with pytest.raises(ValueError, match="at least one byte"):
        pack([3, 0], 2)


def test_rows_for_memory_fill_a_budget_and_stay_bounded() -> None:
    rows = rows_for_memory(MLSTM(tiny()), torch.device("cpu"))
    assert 1 <= rows <= 4096
    assert rows_for_memory(MLSTM(MLSTMConfig(hidden_size=4096)), torch.device("cpu")) < rows


def test_packing_and_padding_never_change_a_feature() -> None:
    torch.manual_seed(0)
    model = MLSTM(tiny())
    rng = np.random.default_rng(1)
    texts = ["".join(rng.choice(list("abc de!"), size=n)) for n in [1, 3, 40, 41, 300, 7, 7, 90, 600, 12]]
    alone = featurize(model, texts, batch_size=1)
    reference = MLSTM(model.config, recurrence="reference")
    reference.load_state_dict(model.state_dict())
    for batch_size, max_padding in ((None, MAX_PADDING), (4, 0.0), (10, 0.99), (3, MAX_PADDING)):
        # Packed (fused: rows read several texts, a row's state restarting at each) and length-bucketed.
        for reader in (model, reference):
            together = featurize(reader, texts, batch_size=batch_size, max_padding=max_padding)
            np.testing.assert_allclose(
                together,
                alone,
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{reader.recurrence} {batch_size}, {max_padding}",
            )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_full_chunks_through_the_replayed_program_equal_the_plain_path(precision: str) -> None:
    """``replay``: the chunks where every row reads go through ``_FullChunks`` (a CUDA graph on a GPU;
    here its eager twin), the last ones through the plain path: the same features as the plain path
    (itself held to each text read alone above), on mixed lengths that make two full chunks and a
    ragged end; in bf16 too, where the carried h is in the products' dtype."""
    torch.manual_seed(0)
    model = MLSTM(tiny())
    rng = np.random.default_rng(3)
    lengths = [1, 2, 5, 40, 300, 41, 7, 90, 600, 12, 255, 256, 257, 513, 30, 3, 64, 128]
    texts = ["".join(rng.choice(list("good bad film!"), size=n)) for n in lengths]
    packing = pack([len(encode(t)) for t in texts], 4)
    assert int(packing.row_steps_S[-1]) // CHUNK_LEN >= 2 and packing.steps > int(packing.row_steps_S[-1])
    plain = featurize(model, texts, batch_size=4, precision=precision, replay=False)
    replayed = featurize(model, texts, batch_size=4, precision=precision, replay=True)
    np.testing.assert_allclose(replayed, plain, rtol=1e-6, atol=1e-7)  # and the plain path, alone's


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


def test_bf16_features_on_a_cpu_are_near_fp32_s_and_read_in_bf16() -> None:
    """``precision="bf16"`` runs the products in bf16 on a CPU (faster where the CPU has it in hardware,
    at 1,024 units and more): features within 2 % of fp32's largest, not equal to them; auto stays fp32, bit for bit."""
    torch.manual_seed(0)
    model = MLSTM(tiny())
    rng = np.random.default_rng(2)
    texts = ["".join(rng.choice(list("abc de!"), size=n)) for n in [5, 40, 300, 900, 12, 77]]
    fp32 = featurize(model, texts, precision="fp32")
    np.testing.assert_array_equal(featurize(model, texts), fp32)  # auto on a CPU is fp32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a CPU that emulates bf16: slower, same values
        bf16 = featurize(model, texts, precision="bf16")
    assert bf16.dtype == np.float32
    gap = np.abs(bf16 - fp32).max() / np.abs(fp32).max()
    assert 0 < gap < 2e-2, gap


def test_bf16_on_a_cpu_without_it_in_hardware_warns_that_it_is_slower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(models.precision, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="emulated, slower than fp32"):
        featurize(MLSTM(tiny()), ["a review"], precision="bf16")
    monkeypatch.setattr(models.precision, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        featurize(MLSTM(tiny()), ["a review"], precision="bf16")


def test_a_bf16_batch_holds_more_rows_than_an_fp32_one() -> None:
    """The products' inputs halve in bf16; the cell states kept for the features stay fp32."""
    model, cpu = MLSTM(MLSTMConfig(hidden_size=1024)), torch.device("cpu")
    fp32 = rows_for_memory(model, cpu, memory_bytes=2**30)
    assert rows_for_memory(model, cpu, memory_bytes=2**30, dtype=torch.float32) == fp32
    assert 1.4 * fp32 < rows_for_memory(model, cpu, memory_bytes=2**30, dtype=torch.bfloat16) < 2 * fp32


def test_every_precision_the_settings_take_is_one_the_model_reads_in() -> None:
    """The settings' and CLI's type (``tasks.pretrain.config.Precision``, what pydantic and typer check)
    and the names ``models.precision`` resolves, which the served model checks a request against."""
    from typing import get_args

    from tasks.jobs.config import Precision

    assert get_args(Precision) == models.precision.PRECISION_CHOICES
    cpu = torch.device("cpu")
    assert [models.precision.resolve_precision(name, cpu) for name in get_args(Precision)] == [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float32,
    ]
