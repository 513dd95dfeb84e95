"""A corpus's key index: the keys of its kept rows, one sorted Arrow file per bucket, so a delta is
deduplicated against its base by reading 16 bytes a row, never the base's text.

``keys/bucket-BBBBB.arrow`` holds the (key_hi, key_lo) of every row the bucket kept, all splits, in key
order; the manifest lists each file with the range of ``key_hi`` it covers. A delta's bucket covers a
range of ``key_hi`` too (buckets are a range partition), so it reads only the base's files that
overlap it, one at a time: memory holds the delta's bucket and one base bucket's keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tasks.corpus.manifest import KeyFile
from tasks.store import Store

KEY_SCHEMA = pa.schema([("key_hi", pa.uint64()), ("key_lo", pa.uint64())])


@dataclass(frozen=True, kw_only=True)
class BaseKeys:
    """What a delta's tasks need of its base: the store keys of its key files and their ranges."""

    corpus_id: str
    manifest_key: str
    files: tuple[tuple[str, int, int], ...]  # (store key, lowest key_hi, highest key_hi)


def write_key_file(
    store: Store, prefix: str, name: str, key_hi: np.ndarray, key_lo: np.ndarray
) -> KeyFile | None:
    """Write sorted keys to ``prefix/name``; the manifest's entry for it (None for no key: no file)."""
    if not len(key_hi):
        return None
    table = pa.table({"key_hi": pa.array(key_hi), "key_lo": pa.array(key_lo)}, schema=KEY_SCHEMA)
    with store.writer(f"{prefix}/{name}") as path:
        with pa.ipc.new_file(str(path), KEY_SCHEMA) as writer:
            writer.write_table(table)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()  # a bucket's keys: 16 bytes a row
    return KeyFile(path=name, rows=len(key_hi), lo=int(key_hi[0]), hi=int(key_hi[-1]), sha256=digest)


def held_by_base(store: Store, base: BaseKeys, key_hi: np.ndarray, key_lo: np.ndarray) -> np.ndarray:
    """For each (distinct) key, whether the base holds it: True where a base key file has it."""
    held = np.zeros(len(key_hi), dtype=bool)
    if not len(key_hi):
        return held
    low, high = int(key_hi.min()), int(key_hi.max())
    for key, first, last in base.files:
        if last < low or first > high:
            continue  # another part of the key space
        with store.local_copy(key) as path:
            table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            base_hi, base_lo = table["key_hi"].to_numpy(), table["key_lo"].to_numpy()
            # Only the base keys in this range: sorted by key_hi, so a slice.
            start = int(np.searchsorted(base_hi, np.uint64(low), side="left"))
            stop = int(np.searchsorted(base_hi, np.uint64(high), side="right"))
            held |= _members(key_hi, key_lo, base_hi[start:stop], base_lo[start:stop])
            del table, base_hi, base_lo
    return held


def _members(hi: np.ndarray, lo: np.ndarray, base_hi: np.ndarray, base_lo: np.ndarray) -> np.ndarray:
    """Which (hi, lo) pairs are among the base pairs, which are distinct and sorted by (hi, lo) as a key
    file holds them: a binary search of each pair's hi, then its lo among the base's pairs of that hi
    (one, but for the rare hi two 128-bit keys share): m log n, where sorting the m delta keys with the
    n base keys was most of a large corpus's delta build (docs/benchmarks.md, corpus grown by a delta)."""
    first = np.searchsorted(base_hi, hi, side="left")
    stop = np.searchsorted(base_hi, hi, side="right")
    held = np.zeros(len(hi), dtype=bool)
    single = stop - first == 1
    held[single] = base_lo[first[single]] == lo[single]
    for at in np.flatnonzero(stop - first > 1):
        run = base_lo[first[at] : stop[at]]
        place = int(np.searchsorted(run, lo[at]))
        held[at] = place < len(run) and run[place] == lo[at]
    return held


def key_files(entries: Iterable[tuple[str, KeyFile]]) -> tuple[tuple[str, int, int], ...]:
    """(store key, lo, hi) of each key file, from (the key it resolves to, its entry)."""
    return tuple((key, entry.lo, entry.hi) for key, entry in entries)
