"""A corpus split as one long byte stream, read in batches whose position is a function of the step.

The global batch has B rows; row r owns the r-th of B equal, contiguous segments of the stream and
reads it T bytes a step, so the hidden state carries from one step to the next (truncated BPTT).
Rank k of W reads rows [k·B/W, (k+1)·B/W). Where a step reads depends on nothing but the step, so
resuming is exact and O(1), with any number of ranks. An epoch is the number of whole steps a
segment holds; the next epoch starts over (and the training job resets the state there).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from tasks.corpus.manifest import locate, read_manifest, shard_key
from tasks.corpus.reviews import string_buffers
from tasks.store import LocalStore, Store


class StreamError(ValueError):
    """A stream that cannot serve the batches asked of it; the message says what to change."""


class ByteStream:
    """The concatenated UTF-8 bytes of the ``text`` column of Arrow IPC shards, in order.

    Shards are memory-mapped and their text buffers viewed, not copied: a 40 GB corpus costs
    address space, not memory.
    """

    def __init__(self, paths: list[Path]) -> None:
        self._parts: list[np.ndarray] = []
        for path in paths:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
            for index in range(reader.num_record_batches):
                text = reader.get_batch(index).column("text")
                if len(text) == 0:
                    continue
                offsets, data = string_buffers(text)
                self._parts.append(data[offsets[0] : offsets[-1]])
        self._starts = np.cumsum([0] + [len(p) for p in self._parts])

    @classmethod
    def of(cls, data: np.ndarray) -> ByteStream:
        """A stream over bytes already in memory (uint8): a held-out text a benchmark scores a model on."""
        stream = cls([])
        stream._parts, stream._starts = [data], np.array([0, len(data)])
        return stream

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """``length`` bytes from ``start`` (a copy), crossing shard and batch boundaries."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"bytes [{start}, {start + length}) are outside a stream of {len(self)}")
        out = np.empty(length, dtype=np.uint8)
        part = int(np.searchsorted(self._starts, start, side="right")) - 1
        written = 0
        while written < length:
            offset = start + written - int(self._starts[part])
            chunk = self._parts[part][offset : offset + length - written]
            out[written : written + len(chunk)] = chunk
            written += len(chunk)
            part += 1
        return out


def check_world(batch_size: int, world_size: int, rank: int) -> None:
    """A global batch the ranks can share, and a rank inside its world: a StreamError naming them."""
    if batch_size % world_size:
        raise StreamError(
            f"batch size {batch_size} is not divisible by {world_size} ranks: "
            "choose a batch size that is a multiple of the number of processes"
        )
    if not 0 <= rank < world_size:
        raise StreamError(f"rank {rank} is outside a world of {world_size}")


@dataclass(frozen=True)
class BatchPlan:
    """Which bytes a rank reads at a step: B rows of T + 1 bytes (inputs and next-byte targets)."""

    stream_bytes: int
    batch_size: int
    seq_len: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        check_world(self.batch_size, self.world_size, self.rank)
        if self.steps_per_epoch < 1:
            raise StreamError(
                f"a stream of {self.stream_bytes:,} bytes gives each of {self.batch_size} rows "
                f"{self.segment_bytes:,} bytes, fewer than one step of {self.seq_len + 1}: "
                "use a smaller batch or sequence length, or a larger corpus split"
            )

    @property
    def segment_bytes(self) -> int:
        return self.stream_bytes // self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        # The last target of a step is the first input of the next, hence the - 1.
        return (self.segment_bytes - 1) // self.seq_len

    @property
    def rows(self) -> range:
        per_rank = self.batch_size // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def starts(self, step: int) -> np.ndarray:
        """Stream offsets of this rank's rows at ``step`` (0-based)."""
        within = (step % self.steps_per_epoch) * self.seq_len
        return np.array([row * self.segment_bytes + within for row in self.rows], dtype=np.int64)

    def batch(self, stream: ByteStream, step: int) -> np.ndarray:
        """[rows of this rank, T + 1] bytes: inputs are [:, :-1], targets [:, 1:]."""
        return np.stack([stream.read(int(s), self.seq_len + 1) for s in self.starts(step)])


def split_shards(
    store: Store, manifest_key: str, split: str, cache_dir: Path, keep: frozenset[str] | None = None
) -> list[Path]:
    """Local paths of a split's shards, in manifest order (only those whose sha256 is in ``keep``, when
    given: a continued run's new shards); S3 shards are downloaded once to the cache and checked
    against their sha256."""
    manifest = read_manifest(store, manifest_key)
    if split not in manifest.splits:
        raise StreamError(f"the corpus has no split {split!r}: it has {', '.join(manifest.splits)}")
    paths = []
    for shard in manifest.shards(split):
        if keep is not None and shard.sha256 not in keep:
            continue
        key = shard_key(manifest_key, shard.path)
        if isinstance(store, LocalStore):
            paths.append(store.path(key))
            continue
        # By the corpus holding the shard (a grown corpus's base's shards are its base's).
        target = cache_dir / (
            key.removeprefix("corpora/") if key.startswith("corpora/") else f"{manifest.corpus_id}/{key}"
        )
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".part")
            store.download(key, partial)
            with partial.open("rb") as stream:
                digest = hashlib.file_digest(stream, "sha256").hexdigest()  # chunked, not read whole
            if digest != shard.sha256:
                partial.unlink()
                raise StreamError(f"shard {key} does not match its sha256 in the manifest")
            partial.rename(target)
        paths.append(target)
    return paths


def open_split(
    manifest_uri: str,
    split: str,
    cache_dir: Path,
    *,
    keep: frozenset[str] | None = None,
    **store_options: object,
) -> ByteStream:
    """The byte stream of one split of a corpus, by its manifest URI (``keep``: as in ``split_shards``)."""
    store, key = locate(manifest_uri, **store_options)
    if not store.exists(key):
        raise StreamError(
            f"no corpus manifest at {manifest_uri}: build one with `mlstm-sentiment corpus build`"
        )
    return ByteStream(split_shards(store, key, split, cache_dir, keep))
