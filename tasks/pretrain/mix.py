"""Which bytes each row of a training batch reads: one stream, or a continued run's two.

A run from its own seed reads the train split as one stream (``stream.py``): row r of B owns the r-th of
B contiguous segments. A continued run (``--init-from``) reads two streams. The *fresh* one is the shards
of its corpus that the parent's corpus does not hold, by sha256: a grown corpus's delta, every shard of
an unrelated corpus, or the whole split when nothing is new (the parent's own corpus, trained again on a
schedule of its own). The *replay* one is the parent corpus's train split. Of the B rows, round(replay ·
B) read the replay stream and the rest the fresh one; which rows is a permutation drawn from the seed, so
they spread over the ranks. Each stream is laid out over its own rows exactly as a plain run lays out
its split, so where a row reads is a function of the step alone: a resume is exact and O(1), at any
world size. The streams' epochs differ (the replay is long and has few rows): a row starts over, its
state zeroed, when its own stream does. A plain run is the case of no replay rows, byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasks.corpus.manifest import Manifest, ManifestError, NoManifest, check_shards, load_manifest
from tasks.pretrain.config import TrainSettings
from tasks.pretrain.parent import Parent
from tasks.pretrain.stream import BatchPlan, ByteStream, StreamError, check_world
from tasks.store import StoreError


def train_shards(manifest: Manifest) -> dict[str, int]:
    """A manifest's train shards (a grown corpus's base shards too), sha256 → text bytes."""
    return {shard.sha256: shard.text_bytes for shard in manifest.shards("train")}


@dataclass(frozen=True)
class Sources:
    """What a run's rows read: the fresh shards of its corpus (by sha256; None, the whole train split)
    and their bytes, and the bytes of the parent corpus's train split when rows replay it."""

    fresh: frozenset[str] | None
    fresh_bytes: int
    replay_bytes: int = 0


def sources(manifest: Manifest, parent_manifest: Manifest | None, *, replay: bool) -> Sources:
    """The fresh shards of ``manifest`` beside ``parent_manifest`` (the parent's corpus; None for a run
    from its own seed), and the replay's bytes when ``replay``."""
    shards = train_shards(manifest)
    if parent_manifest is None:
        return Sources(fresh=None, fresh_bytes=sum(shards.values()))
    parents = train_shards(parent_manifest)
    new = {digest: size for digest, size in shards.items() if digest not in parents}
    replay_bytes = sum(parents.values()) if replay else 0
    if not new:  # the parent's own corpus (or part of it): the run trains on all of it again
        return Sources(fresh=None, fresh_bytes=sum(shards.values()), replay_bytes=replay_bytes)
    return Sources(fresh=frozenset(new), fresh_bytes=sum(new.values()), replay_bytes=replay_bytes)


def train_sources(
    settings: TrainSettings, manifest: Manifest, parent: Parent | None, **store_options: Any
) -> Sources:
    """What a run's rows read: a run from its own seed, its corpus's train split; a continued run, the
    new shards found beside its parent's corpus, whose train split its replay rows read."""
    if parent is None:
        return sources(manifest, None, replay=False)
    try:
        store, key, parent_manifest = load_manifest(parent.corpus, **store_options)
        if settings.replay:
            check_shards(store, key, parent_manifest, ("train",))
    except (NoManifest, StoreError, OSError, ManifestError) as error:
        raise ValueError(
            f"--init-from {parent.checkpoint_uri}: the corpus it was trained on is not readable ({error}): "
            "a continued run reads it to find what is new and to replay it"
        ) from None
    return sources(manifest, parent_manifest, replay=settings.replay > 0)


def replay_rows(batch_size: int, share: float, seed: int) -> tuple[int, ...]:
    """The rows of the global batch that read the replay stream: round(share · B) of them, drawn by the
    seed. A share that rounds to no row, or to every row, is refused: it would not be the share asked for."""
    count = math.floor(share * batch_size + 0.5)  # half up: Python's round(0.5) is 0
    if share > 0 and count == 0:
        raise StreamError(
            f"--replay {share:g} of a batch of {batch_size} rows rounds to no row: give a share of at "
            f"least {0.5 / batch_size:.3g}, or a larger --batch-size"
        )
    if count >= batch_size:
        raise StreamError(
            f"--replay {share:g} of a batch of {batch_size} rows leaves no row for the new data: give a "
            "smaller share, or a larger --batch-size"
        )
    order = np.random.default_rng(seed).permutation(batch_size)
    return tuple(sorted(int(row) for row in order[:count]))


@dataclass(frozen=True)
class RowPlan:
    """Where each of a rank's rows reads at a step: B rows of T + 1 bytes, each from its stream."""

    fresh_bytes: int
    replay_bytes: int
    batch_size: int
    seq_len: int
    replay: tuple[int, ...] = ()  # the global rows that read the replay stream
    world_size: int = 1
    rank: int = 0
    _streams: tuple[BatchPlan, ...] = field(init=False, repr=False)
    _rows: tuple[tuple[int, int], ...] = field(init=False, repr=False)  # (stream, row in it) per row

    def __post_init__(self) -> None:
        check_world(self.batch_size, self.world_size, self.rank)
        # Each raises for a stream too short for its rows.
        fresh = BatchPlan(self.fresh_bytes, self.batch_size - len(self.replay), self.seq_len)
        streams = [fresh]
        if self.replay:
            streams.append(BatchPlan(self.replay_bytes, len(self.replay), self.seq_len))
        replayed = {row: index for index, row in enumerate(self.replay)}
        fresh_rows = [row for row in range(self.batch_size) if row not in replayed]
        placed = {row: (0, index) for index, row in enumerate(fresh_rows)}
        placed.update({row: (1, index) for row, index in replayed.items()})
        object.__setattr__(self, "_streams", tuple(streams))
        object.__setattr__(self, "_rows", tuple(placed[row] for row in self.rows))

    @property
    def rows(self) -> range:
        """This rank's rows of the global batch."""
        per_rank = self.batch_size // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def steps_per_epoch(self) -> int:
        """Steps in one pass of the fresh stream: the schedule's default length."""
        return self._streams[0].steps_per_epoch

    def starts(self, step: int) -> list[tuple[int, int]]:
        """(stream, offset) of this rank's rows at ``step``: stream 0 the fresh one, 1 the replay."""
        out = []
        for stream, index in self._rows:
            plan = self._streams[stream]
            within = (step % plan.steps_per_epoch) * plan.seq_len
            out.append((stream, index * plan.segment_bytes + within))
        return out

    def restarts(self, step: int) -> np.ndarray:
        """Which of this rank's rows start their stream over at ``step``: their carried state is zeroed."""
        if step == 0:
            return np.zeros(len(self._rows), dtype=bool)
        return np.array(
            [
                self._streams[stream].epoch_of(step) != self._streams[stream].epoch_of(step - 1)
                for stream, _ in self._rows
            ]
        )

    def batch(self, fresh: ByteStream, replay: ByteStream | None, step: int) -> np.ndarray:
        """[rows of this rank, T + 1] bytes: inputs are [:, :-1], targets [:, 1:]."""
        streams = (fresh, replay)
        reads = []
        for stream, start in self.starts(step):
            source = streams[stream]
            assert source is not None, "a replay row needs the replay stream"
            reads.append(source.read(start, self.seq_len + 1))
        return np.stack(reads)
