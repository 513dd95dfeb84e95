"""Feature files: computed and written to the store in chunks, in input order, read memory-mapped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from models.features import featurize
from models.mlstm import MLSTM, tiny
from tasks.store import LocalStore
from tasks.transfer import features as features_module
from tasks.transfer.features import cached_features, copy_with_columns, features_of, read_table
from tasks.transfer.precomputed import read_split

TEXTS = [f"review {i}: " + "good " * (i % 4) + "bad " * (3 - i % 4) for i in range(10)]
LABELS = np.array([i % 2 for i in range(10)], dtype=np.int64)


@pytest.fixture(scope="module")
def model() -> MLSTM:
    torch.manual_seed(0)
    return MLSTM(tiny()).eval()


def test_features_are_written_chunk_by_chunk_as_computed_and_read_back_memory_mapped(
    model: MLSTM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "store")
    computed: list[tuple[int, int]] = []  # (rows featurized in the call, bytes already in the file)

    def spy(model: MLSTM, texts: list[str], **kwargs: object) -> np.ndarray:
        partial = list((tmp_path / "store").rglob(".tmp-*"))  # the file being written, not yet published
        computed.append((len(texts), sum(p.stat().st_size for p in partial)))
        return featurize(model, texts, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(features_module, "featurize", spy)
    found = cached_features(
        store, model, TEXTS, name="train", columns={"label": LABELS}, chunk_rows=3, device=torch.device("cpu")
    )
    assert not found.cached and (found.rows, found.width) == (10, 64)
    # Four chunks of at most 3 rows, each featurized alone; the file grows between them.
    assert [rows for rows, _ in computed] == [3, 3, 3, 1]
    sizes = [size for _, size in computed]
    assert sizes[1:] == sorted(sizes[1:]) and sizes[-1] > sizes[1] > 0, sizes
    with pa.memory_map(str(store.path(found.key))) as source:
        assert pa.ipc.open_file(source).num_record_batches == 4

    X, y = read_split(found.uri)
    np.testing.assert_allclose(X, featurize(model, TEXTS, device=torch.device("cpu")), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y, LABELS)  # rows in input order, labels beside them

    computed.clear()
    again = cached_features(store, model, TEXTS, name="train", columns={"label": LABELS}, chunk_rows=3)
    assert again.cached and again.uri == found.uri and computed == []


def test_a_single_chunk_file_is_read_without_a_copy(model: MLSTM, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    found = cached_features(store, model, TEXTS, columns={"label": LABELS}, device=torch.device("cpu"))
    X, _ = read_split(found.uri)
    assert not X.flags.owndata and not X.flags.writeable  # a view of the mapped file


def test_the_output_keeps_the_inputs_other_columns_chunk_by_chunk(model: MLSTM, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    found = cached_features(store, model, TEXTS, chunk_rows=4, device=torch.device("cpu"))
    ids = np.array([f"r{i}" for i in range(10)], dtype=object)
    uri = copy_with_columns(store, found.key, str(tmp_path / "out.arrow"), {"id": ids, "label": LABELS})
    with pa.memory_map(uri) as source:
        reader = pa.ipc.open_file(source)
        assert reader.num_record_batches == 3
        table = reader.read_all()
    assert table.column_names == ["id", "label", "features"]
    assert table.column("id").to_pylist() == ids.tolist()
    X, y = read_split(uri)
    np.testing.assert_array_equal(y, LABELS)
    np.testing.assert_array_equal(X, features_of(read_table(store, found.key)))


def test_a_column_of_another_length_is_refused_before_any_work(model: MLSTM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="column 'label' has 3 values for 10 texts"):
        cached_features(LocalStore(tmp_path), model, TEXTS, columns={"label": LABELS[:3]})
    assert not list(tmp_path.rglob("*.arrow"))


def test_the_stage_sizes_feature_batches_by_memory_unless_told(
    model: MLSTM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models.features
    from tasks.transfer.stage import TransferParams

    sized: list[int] = []
    real = models.features.rows_for_memory

    def counted(*args: object, **kwargs: object) -> int:
        sized.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return sized[-1]

    monkeypatch.setattr(models.features, "rows_for_memory", counted)
    texts = ["great", "awful!", "fine, I guess"]
    cached_features(LocalStore(tmp_path / "a"), model, texts)  # the stage's and the CLI's default
    assert sized and sized[0] > 64  # sized to memory: a CPU's 1 GiB holds far more tiny rows than 64
    cached_features(LocalStore(tmp_path / "b"), model, texts, batch_size=2)
    assert len(sized) == 1  # a batch size given is used as it is
    assert TransferParams.model_fields["batch_size"].default is None


@pytest.mark.filterwarnings("ignore:bf16 features on a CPU")  # a CPU that emulates bf16: slower, same values
def test_bf16_features_are_cached_apart_from_fp32_ones(model: MLSTM, tmp_path: Path) -> None:
    """Features read in bf16 differ from fp32's: a bf16 request never gets fp32's file, nor the other
    way round, and fp32's file keeps the name it had before precisions were told apart."""
    store = LocalStore(tmp_path)
    fp32 = cached_features(store, model, TEXTS, name="train")
    assert fp32.key.endswith("/train.arrow")
    bf16 = cached_features(store, model, TEXTS, name="train", precision="bf16")
    assert not bf16.cached and bf16.key.endswith("/train.bf16.arrow")
    assert cached_features(store, model, TEXTS, name="train", precision="fp32").key == fp32.key
    again = cached_features(store, model, TEXTS, name="train", precision="bf16")
    assert again.cached and again.key == bf16.key
    a, b = features_of(read_table(store, fp32.key)), features_of(read_table(store, bf16.key))
    assert not np.array_equal(a, b)
    np.testing.assert_allclose(b, a, atol=2e-2 * np.abs(a).max())
