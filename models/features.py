"""Texts to features: the mLSTM's final cell state after reading each cleaned text (Radford et al. 2017).

Texts are read longest first in batches of similar length (a batch closes before its padding passes
``max_padding`` of the bytes it holds), as many rows as fit the device's memory unless a batch size is
given, and the model masks what padding there is: a text's feature is the same alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from models.mlstm import MLSTM
from models.precision import autocast, resolve_precision
from models.text import encode

# Called after each batch with (rows, bytes) read, for progress bars.
OnBatch = Callable[[int, int], None]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The fused feature path reads 256 bytes of a row at a time (MLSTM.final_cell_state's chunk_len).
CHUNK_LEN = 256
MAX_PADDING = 0.1  # of the bytes a batch holds: the bound
MAX_ROWS = 4096  # beyond this a batch no longer gets faster, only later to finish


def batch_memory_default(device: torch.device, *, fraction: float = 0.5) -> int:
    """Bytes feature batches may take when not told: ``fraction`` of the device's free memory, taken as
    1 GiB on a CPU (where free memory says little: other processes and the page cache share it)."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**30
    return int(free * fraction)


def rows_for_memory(
    model: MLSTM, device: torch.device, *, fraction: float = 0.5, memory_bytes: int | None = None
) -> int:
    """Rows per feature batch that fit in ``memory_bytes``, or else in ``batch_memory_default``."""
    H, E = model.config.hidden_size, model.config.embed_size
    elem = 2 if device.type == "cuda" else 4  # autocast's bf16/fp16 on a GPU
    # One chunk's embedding, xz [4H] and xm [H] per byte; h, c and the step's gate temporaries per row.
    # Measured on a CPU (peak RSS of featurize, 1,024 rows of 900 bytes): tiny 408 KiB a row against
    # these 387, small 5,323 against 5,210; the rest is the padded bytes (int64) and their reordered copy.
    per_row = CHUNK_LEN * (E * elem + 5 * H * elem) + 12 * H * 4
    if memory_bytes is None:
        memory_bytes = batch_memory_default(device, fraction=fraction)
    return max(1, min(MAX_ROWS, memory_bytes // per_row))


def length_batches(
    lengths: Sequence[int], batch_size: int, *, max_padding: float = MAX_PADDING
) -> Iterator[np.ndarray]:
    """Row indices in batches of at most ``batch_size``, longest texts first; a batch closes before its
    padding (its rows × its longest length, less the bytes of its texts) passes ``max_padding`` of it."""
    lengths_N = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths_N, kind="stable")
    start = 0
    while start < len(order):
        width = max(int(lengths_N[order[start]]), 1)
        # Longest first, so the width is the first row's; the held bytes only grow by shorter rows.
        held_N = np.cumsum(lengths_N[order[start : start + batch_size]])
        rows_N = np.arange(1, len(held_N) + 1)
        fits = (rows_N * width - held_N) <= max_padding * rows_N * width
        count = int(np.argmin(fits)) if not fits.all() else len(fits)
        yield order[start : start + max(count, 1)]
        start += max(count, 1)


def featurize(
    model: MLSTM,
    texts: Sequence[str],
    *,
    batch_size: int | None = 64,
    device: torch.device | None = None,
    on_batch: OnBatch | None = None,
    max_padding: float = MAX_PADDING,
    memory_bytes: int | None = None,
) -> np.ndarray:
    """Features [N, H] (float32), one row per text in input order, each text cleaned as the corpus was.

    ``batch_size`` None: as many rows as fit ``memory_bytes``, by default half the device's free memory
    (``rows_for_memory``).
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not 0 <= max_padding < 1:
        raise ValueError(f"max_padding must be at least 0 and below 1, got {max_padding}")
    device = device or next(model.parameters()).device
    model = model.to(device).eval()
    encoded = [encode(text) for text in texts]
    features_NH = np.zeros((len(encoded), model.config.hidden_size), dtype=np.float32)
    rows_per_batch = batch_size or rows_for_memory(model, device, memory_bytes=memory_bytes)
    dtype = resolve_precision("auto", device)  # bf16 or fp16 on a GPU, fp32 on the CPU
    for rows in length_batches([len(b) for b in encoded], rows_per_batch, max_padding=max_padding):
        lengths = [len(encoded[r]) for r in rows]
        bytes_BT = np.zeros((len(rows), max(lengths)), dtype=np.int64)
        for b, r in enumerate(rows):
            bytes_BT[b, : lengths[b]] = np.frombuffer(encoded[r], dtype=np.uint8)
        with autocast(device, dtype):
            c_BH = model.final_cell_state(
                torch.from_numpy(bytes_BT).to(device), torch.tensor(lengths, device=device)
            )
        features_NH[rows] = c_BH.float().cpu().numpy()
        if on_batch is not None:
            on_batch(len(rows), sum(lengths))
    return features_NH
