"""Texts to features: the mLSTM's final cell state after reading each cleaned text (Radford et al. 2017).

Texts are read longest first in batches of similar length, so little padding is read at all, and the
model masks what there is: a text's feature is the same alone or in any batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from models.mlstm import MLSTM
from models.text import encode

# Called after each batch with (rows, bytes) read, for progress bars.
OnBatch = Callable[[int, int], None]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on GPUs that have it, fp16 on older ones; full precision on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.autocast("cuda", dtype=dtype)


def length_batches(lengths: Sequence[int], batch_size: int) -> Iterator[np.ndarray]:
    """Row indices in batches of at most ``batch_size``, longest texts first."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def featurize(
    model: MLSTM,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    device: torch.device | None = None,
    on_batch: OnBatch | None = None,
) -> np.ndarray:
    """Features [N, H] (float32), one row per text in input order, each text cleaned as the corpus was."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    device = device or next(model.parameters()).device
    model = model.to(device).eval()
    encoded = [encode(text) for text in texts]
    features_NH = np.zeros((len(encoded), model.config.hidden_size), dtype=np.float32)
    for rows in length_batches([len(b) for b in encoded], batch_size):
        lengths = [len(encoded[r]) for r in rows]
        bytes_BT = np.zeros((len(rows), max(lengths)), dtype=np.int64)
        for b, r in enumerate(rows):
            bytes_BT[b, : lengths[b]] = np.frombuffer(encoded[r], dtype=np.uint8)
        with autocast_for(device):
            c_BH = model.final_cell_state(
                torch.from_numpy(bytes_BT).to(device), torch.tensor(lengths, device=device)
            )
        features_NH[rows] = c_BH.float().cpu().numpy()
        if on_batch is not None:
            on_batch(len(rows), sum(lengths))
    return features_NH
