"""A record's key, the XXH3-128 hash of its cleaned text, and what it decides: its bucket (the top bits,
a range partition, so bucket order is key order) and its split (the low bits against the configured
fractions). Pure functions of the text: neither changes when sources are added or the work is split
differently."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import xxhash

from tasks.corpus.reviews import string_buffers


def text_keys(text: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """XXH3-128 of each (non-null) string's UTF-8 bytes, as two uint64 arrays (hi, lo).

    XXH3's output is frozen by its specification, so keys (and with them splits) never change;
    per string it costs a fifth of blake2b, which matters at a million reviews a second.
    """
    text = text.cast(pa.large_string())
    n = len(text)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    offsets_np, data_np = string_buffers(text)
    offsets, data = offsets_np.tolist(), memoryview(data_np.data)  # Python ints and slices are fastest here
    digest = xxhash.xxh3_128_digest  # big-endian, the canonical form
    packed = b"".join([digest(data[offsets[i] : offsets[i + 1]]) for i in range(n)])
    keys = np.frombuffer(packed, dtype=">u8").reshape(n, 2).astype(np.uint64)
    return keys[:, 0].copy(), keys[:, 1].copy()


def bucket_of(key_hi: np.ndarray, num_buckets: int) -> np.ndarray:
    """Range partition on the top 32 bits: bucket order is key order."""
    return ((key_hi >> np.uint64(32)) * np.uint64(num_buckets)) >> np.uint64(32)


def split_of(key_lo: np.ndarray, fractions: tuple[float, float, float]) -> np.ndarray:
    """0 = train, 1 = val, 2 = test: the low 53 key bits as a uniform number in [0, 1)."""
    uniform = (key_lo >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.searchsorted(np.cumsum(fractions[:2]), uniform, side="right").astype(np.int8)
