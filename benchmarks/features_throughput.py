"""Feature extraction throughput, the rows of ``benchmarks/features.py``: one preset in one precision.

``feature_row`` times ``models.features.featurize`` (texts packed end to end), the same model with the
reference recurrence (length-bucketed batches) and one text at a time (``baseline_features``) on the
same texts, and checks that their features agree; ``profile_features`` runs featurize under
torch.profiler. The command, its report and the served model's latency live in their own files.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import profile_table, say, synchronize  # the working tree on the path
from features_texts import take

from models.features import featurize, length_batches, pack, rows_for_memory
from models.mlstm import MLSTM, preset
from models.precision import PRECISION_NAMES, autocast, resolve_precision
from models.text import encode

# The fast path and the baseline run the same weights on the same bytes: in fp32 they differ only by
# summation order. Under bf16/fp16 autocast the recurrence rounds differently in a batch and alone.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}


@dataclass
class FeatureRow:
    preset: str
    num_params: int
    device: str
    precision: str  # the products' dtype: fp32, bf16 or fp16
    batch_size: int  # rows per batch at most: --batch-size, or sized by memory
    batch_sized_by: str  # "memory" or "--batch-size"
    texts: int
    chars: int  # bytes the model read
    padding: float  # padding bytes ÷ the bytes the reference path's length-bucketed batches hold
    rows: int  # rows the fast path packed the texts into (models.features.pack)
    steps: int  # its steps
    idle: float  # its row-steps that read no byte (as rows run out of texts at the end) ÷ all of them
    seconds: float
    chars_per_s: float
    reference_seconds: float
    reference_chars_per_s: float
    vs_reference: float  # fast chars/s ÷ reference chars/s
    baseline_texts: int
    baseline_chars: int
    baseline_seconds: float
    baseline_chars_per_s: float
    ratio: float  # fast chars/s ÷ baseline chars/s
    max_rel_diff: float  # over the baseline's texts: max|fast − baseline| ÷ max|baseline|, the largest
    tolerance: float
    # Against the first precision's row of the same preset (--precisions): fast chars/s ratio, and the
    # largest max|this − that| ÷ max|that| over the fast path's texts. None for the first.
    vs_first_precision: float | None = None
    first_precision_rel_diff: float | None = None


def precision_of(device: torch.device, precision: str = "auto") -> str:
    return PRECISION_NAMES[resolve_precision(precision, device)]


@torch.no_grad()
def baseline_features(model: MLSTM, texts: list[str], device: torch.device, precision: str) -> np.ndarray:
    """The named baseline: each text alone, batch of 1, through ``model(bytes[None])``; its final c."""
    features_NH = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    for n, text in enumerate(texts):
        bytes_T = torch.frombuffer(bytearray(encode(text)), dtype=torch.uint8).long().to(device)
        with autocast(device, resolve_precision(precision, device)):
            _, (_, c_1H), _ = model(bytes_T[None])
        features_NH[n] = c_1H[0].float().cpu().numpy()
    return features_NH


def max_relative_difference(fast_NH: np.ndarray, baseline_NH: np.ndarray) -> float:
    scale_N = np.abs(baseline_NH).max(axis=1)
    return float((np.abs(fast_NH - baseline_NH).max(axis=1) / np.maximum(scale_N, 1e-30)).max())


def feature_row(
    name: str,
    pool: list[str],
    n_fast: int,
    n_baseline: int,
    batch_size: int | None,
    device: torch.device,
    precision: str = "auto",
) -> tuple[FeatureRow, np.ndarray]:
    """The row, and the fast path's features (for the comparison across precisions)."""
    torch.manual_seed(0)
    model = MLSTM(preset(name)).to(device).eval()
    reference = MLSTM(model.config, recurrence="reference").to(device).eval()
    reference.load_state_dict(model.state_dict())
    dtype = resolve_precision(precision, device)
    rows = batch_size or rows_for_memory(model, device, dtype=dtype)
    fast_texts, baseline_texts = take(pool, n_fast), take(pool, n_baseline)
    # Warm-up for all three (kernels, compilation, autocast, allocator): a few texts, not timed.
    warm = sorted(fast_texts, key=len)[:8]
    featurize(model, warm, batch_size=rows, device=device, precision=precision)
    featurize(reference, warm[:2], batch_size=rows, device=device, precision=precision)
    baseline_features(model, warm[:2], device, precision)

    def timed(
        what: str, run: Callable[..., np.ndarray], *args: Any, **kwargs: Any
    ) -> tuple[np.ndarray, float]:
        """``run(*args, **kwargs)``'s features and its seconds, the device's queue empty before and after."""
        say(f"  {name}: {what} …")
        synchronize(device)
        started = time.perf_counter()
        features = run(*args, **kwargs)
        synchronize(device)
        return features, time.perf_counter() - started

    on_device = {"batch_size": rows, "device": device, "precision": precision}
    batches = f"{n_fast} texts in batches of {rows}"
    fast_NH, seconds = timed(f"fast path, {batches}", featurize, model, fast_texts, **on_device)
    reference_NH, reference_seconds = timed(
        f"reference recurrence, {batches}", featurize, reference, fast_texts, **on_device
    )
    baseline_NH, baseline_seconds = timed(
        f"baseline, {n_baseline} texts one at a time",
        baseline_features,
        model,
        baseline_texts,
        device,
        precision,
    )

    # Parity on every text the baseline read; the fast path's feature of a text does not depend on its batch.
    compare = min(n_fast, n_baseline)
    extra = featurize(model, baseline_texts[compare:], batch_size=rows, device=device, precision=precision)
    diff = max_relative_difference(np.concatenate([fast_NH[:compare], extra]), baseline_NH)
    diff = max(diff, max_relative_difference(fast_NH, reference_NH))

    lengths = np.array([len(encode(t)) for t in fast_texts])
    chars = int(lengths.sum())
    held = sum(len(batch) * int(lengths[batch].max()) for batch in length_batches(lengths.tolist(), rows))
    packing = pack(lengths.tolist(), rows)
    row_steps = len(packing.row_steps_S) * packing.steps
    baseline_chars = sum(len(encode(t)) for t in baseline_texts)
    precision = PRECISION_NAMES[dtype]
    row = FeatureRow(
        preset=name,
        num_params=model.config.num_params,
        device=str(device),
        precision=precision,
        batch_size=rows,
        batch_sized_by="--batch-size" if batch_size else "memory",
        texts=n_fast,
        chars=chars,
        padding=(held - chars) / held,
        rows=len(packing.row_steps_S),
        steps=packing.steps,
        idle=(row_steps - chars) / row_steps,
        seconds=seconds,
        chars_per_s=chars / seconds,
        reference_seconds=reference_seconds,
        reference_chars_per_s=chars / reference_seconds,
        vs_reference=reference_seconds / seconds,
        baseline_texts=n_baseline,
        baseline_chars=baseline_chars,
        baseline_seconds=baseline_seconds,
        baseline_chars_per_s=baseline_chars / baseline_seconds,
        ratio=(chars / seconds) / (baseline_chars / baseline_seconds),
        max_rel_diff=diff,
        tolerance=TOLERANCE[precision],
    )
    del model, reference
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, fast_NH


def profile_features(
    name: str, texts: list[str], batch_size: int | None, device: torch.device, path: Path
) -> None:
    """featurize of ``texts`` under torch.profiler after a warm-up on them; operators by device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = MLSTM(preset(name)).to(device).eval()
    rows = batch_size or rows_for_memory(model, device)
    featurize(model, texts, batch_size=rows, device=device)  # compilation and the allocator stay out
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    started = time.perf_counter()
    with profile(activities=activities) as profiler:
        featurize(model, texts, batch_size=rows, device=device)
        synchronize(device)
    seconds = time.perf_counter() - started
    lengths = [len(encode(t)) for t in texts]
    chars = sum(lengths)
    packing = pack(lengths, rows)
    text = profile_table(profiler, device)
    header = (
        f"{name} featurize on {device}: {len(texts)} texts, {chars:,} chars (longest {max(lengths):,}), "
        f"packed into {len(packing.row_steps_S)} rows × {packing.steps:,} steps, {seconds:.3f} s profiled, "
        f"{chars / seconds:,.0f} chars/s"
    )
    path.write_text(header + "\n" + text + "\n")
    say(f"profile of featurize written to {path}")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
