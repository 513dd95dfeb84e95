"""The training byte stream: what the pretraining job reads, where, at each step."""

from __future__ import annotations

from pathlib import Path

import boto3
import numpy as np
import pyarrow as pa
import pytest
from corpus_helpers import build, corpus_dir, read_split

from tasks.corpus.build import CorpusConfig
from tasks.corpus.manifest import Manifest
from tasks.corpus.sample import write_sample
from tasks.pretrain.stream import BatchPlan, ByteStream, StreamError, open_split


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    root = tmp_path_factory.mktemp("stream")
    write_sample(root / "raw", num_reviews=1500)
    return root / "store", build([root / "raw"], root / "store", CorpusConfig(split=(8, 1, 1)))


def _joined(texts: list[str]) -> bytes:
    return "".join(texts).encode()


def test_the_stream_is_the_split_texts_in_manifest_order(
    corpus: tuple[Path, Manifest], tmp_path: Path
) -> None:
    store, manifest = corpus
    uri = str(corpus_dir(store, manifest) / "manifest.json")
    for split in ("train", "val"):
        stream = open_split(uri, split, tmp_path)
        expected = _joined(read_split(store, manifest, split)["text"].to_pylist())
        assert len(stream) == len(expected) == manifest.splits[split].text_bytes
        assert stream.read(0, len(stream)).tobytes() == expected


def test_reads_cross_shard_and_batch_boundaries(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    texts = [f"\n review {i} {'é' * int(rng.integers(0, 9))} " for i in range(300)]
    paths = []
    for number, chunk in enumerate((texts[:100], texts[100:250], texts[250:])):
        path = tmp_path / f"shard-{number}.arrow"
        table = pa.table({"text": pa.array(chunk, pa.large_string())})
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table, max_chunksize=7)  # many record batches per shard
        paths.append(path)
    stream, expected = ByteStream(paths), _joined(texts)
    assert len(stream) == len(expected)
    for start in rng.integers(0, len(expected) - 50, 200).tolist():
        length = int(rng.integers(1, 50))
        assert stream.read(start, length).tobytes() == expected[start : start + length]
    with pytest.raises(IndexError):
        stream.read(len(expected) - 3, 4)


def test_a_stream_over_bytes_in_memory_reads_as_they_are() -> None:
    data = np.frombuffer(b"held-out text\nanother line\n" * 40, dtype=np.uint8)
    stream = ByteStream.of(data)
    assert len(stream) == len(data)
    assert stream.read(5, 20).tobytes() == data[5:25].tobytes()
    plan = BatchPlan(len(stream), 4, 16)
    assert plan.batch(stream, 1).tobytes() == b"".join(
        data[start : start + 17].tobytes() for start in plan.starts(1)
    )
    with pytest.raises(IndexError):
        stream.read(len(data) - 3, 4)


def test_rows_carry_on_from_step_to_step_and_positions_are_pure() -> None:
    plan = BatchPlan(stream_bytes=10_000, batch_size=8, seq_len=16)
    stream_data = np.arange(10_000, dtype=np.int64)
    for step in range(plan.steps_per_epoch - 1):
        now, later = plan.starts(step), plan.starts(step + 1)
        assert (later - now == 16).all()  # the last target of a step is the next step's first input
    assert (plan.starts(plan.steps_per_epoch) == plan.starts(0)).all()  # a new epoch starts over
    assert plan.epoch_of(plan.steps_per_epoch) == 1
    ends = plan.starts(plan.steps_per_epoch - 1) + 16
    assert (ends < np.arange(1, 9) * plan.segment_bytes).all()  # rows never read a neighbour's bytes
    assert len(set(stream_data[plan.starts(3)])) == 8


def test_ranks_split_the_global_batch(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    store, manifest = corpus
    stream = open_split(str(corpus_dir(store, manifest) / "manifest.json"), "train", tmp_path)
    whole = BatchPlan(stream_bytes=len(stream), batch_size=8, seq_len=32)
    for step in (0, 5, whole.steps_per_epoch + 2):
        parts = [
            BatchPlan(stream_bytes=len(stream), batch_size=8, seq_len=32, world_size=4, rank=r).batch(
                stream, step
            )
            for r in range(4)
        ]
        assert np.array_equal(np.concatenate(parts), whole.batch(stream, step))


def test_bad_batch_settings_say_what_to_change() -> None:
    with pytest.raises(StreamError, match="batch size 10 is not divisible by 4 ranks"):
        BatchPlan(stream_bytes=10_000, batch_size=10, seq_len=16, world_size=4)
    with pytest.raises(StreamError, match="fewer than one step"):
        BatchPlan(stream_bytes=1_000, batch_size=256, seq_len=256)


def test_a_split_on_s3_is_downloaded_once_and_checked(
    corpus: tuple[Path, Manifest], s3_bucket: str, tmp_path: Path
) -> None:
    store, manifest = corpus
    base = corpus_dir(store, manifest)
    client = boto3.client("s3")
    for path in base.rglob("*.arrow"):
        client.upload_file(str(path), s3_bucket, f"c/{path.relative_to(base).as_posix()}")
    client.upload_file(str(base / "manifest.json"), s3_bucket, "c/manifest.json")
    uri = f"s3://{s3_bucket}/c/manifest.json"
    stream = open_split(uri, "train", tmp_path / "cache")
    assert stream.read(0, len(stream)).tobytes() == _joined(
        read_split(store, manifest, "train")["text"].to_pylist()
    )
    assert len(list((tmp_path / "cache").rglob("*.arrow"))) == len(manifest.shards("train"))
    with pytest.raises(StreamError, match="no corpus manifest at"):
        open_split(f"s3://{s3_bucket}/nothing/manifest.json", "train", tmp_path / "cache")
    with pytest.raises(StreamError, match="no split 'dev'"):
        open_split(uri, "dev", tmp_path / "cache")
