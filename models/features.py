"""Texts to features: the mLSTM's final cell state after reading each cleaned text (Radford et al. 2017).

The fused recurrence reads texts packed end to end: each of a batch's rows (as many as fit the
device's memory unless a batch size is given, and no more than the texts' bytes over the longest text's)
reads one text after another, longest first, each next text going to the row that frees first, and a
row's state restarts from zero where a text starts.
Every step reads a byte of a text in every row until the rows run out of texts at the end, so the
steps are about (bytes ÷ rows) and wide, whatever the texts' lengths: length-sorted batches of
reviews (mostly short, a few very long) ran thousands of narrow steps per batch. The reference
recurrence reads batches of similar length instead (a batch closes before its padding passes
``max_padding`` of the bytes it holds) and masks the padding. Either way a text's feature is the same
alone or in any batch.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from models.mlstm import MLSTM
from models.precision import autocast, feature_precision, resolve_precision
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
    model: MLSTM,
    device: torch.device,
    *,
    fraction: float = 0.5,
    memory_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> int:
    """Rows per feature batch that fit in ``memory_bytes``, or else in ``batch_memory_default``, read in
    ``dtype`` (default: what ``precision="auto"`` gives on ``device``)."""
    H, E = model.config.hidden_size, model.config.embed_size
    elem = (dtype or resolve_precision("auto", device)).itemsize  # the products' and the inputs' dtype
    # One chunk's embedding, xz [4H] and xm [H] per byte, and its cell states (fp32, kept for the
    # features, and stacked once); h, c and the step's gate temporaries per row. Measured on a CPU (peak
    # RSS of featurize, 1,024 rows of 900 bytes): tiny 459 KiB a row against these 515, small 7,112
    # against 7,280.
    per_row = CHUNK_LEN * (E * elem + 5 * H * elem + 2 * H * 4) + 12 * H * 4
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


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each text is read when texts are laid end to end in rows (``pack``).

    Rows are numbered by how long they read, longest first, so the rows still reading at any step are a
    prefix of the batch."""

    row_N: np.ndarray  # the row text n is read in
    start_N: np.ndarray  # the step its first byte is read at
    lengths_N: np.ndarray
    row_steps_S: np.ndarray  # steps each row reads: non-increasing

    @property
    def steps(self) -> int:
        return int(self.row_steps_S[0]) if len(self.row_steps_S) else 0

    def reading(self, t0: int, t1: int) -> list[int]:
        """Rows reading at each step from t0 to t1 (exclusive)."""
        ascending = self.row_steps_S[::-1]
        reading: list[int] = (
            len(ascending) - np.searchsorted(ascending, np.arange(t0, t1), "right")
        ).tolist()
        return reading


def pack(lengths: Sequence[int], rows: int) -> Packing:
    """Texts longest first, each to the row that frees first (the longest-processing-time rule: the
    rows end within one text's length of each other), then the rows ordered by their ends.

    At most ``rows`` rows, and no more than the texts can keep reading until the longest ends (their
    bytes over its length): more would only add steps where a few rows read, since the longest text's
    length is the least number of steps anyway."""
    lengths_N = np.asarray(lengths, dtype=np.int64)
    if len(lengths_N) and int(lengths_N.min()) < 1:
        raise ValueError("every text must have at least one byte")
    full = -(-int(lengths_N.sum()) // int(lengths_N.max())) if len(lengths_N) else 1
    S = max(1, min(rows, full))
    row_N, start_N = np.zeros(len(lengths_N), np.int64), np.zeros(len(lengths_N), np.int64)
    free = [(0, s) for s in range(S)]  # (the step a row frees at, the row): a heap
    for n in np.argsort(-lengths_N, kind="stable").tolist():
        at, s = free[0]
        row_N[n], start_N[n] = s, at
        heapq.heapreplace(free, (at + int(lengths_N[n]), s))
    steps_S = np.zeros(S, np.int64)
    for at, s in free:
        steps_S[s] = at
    by_steps = np.argsort(-steps_S, kind="stable")  # old row numbers, longest first
    renumber = np.empty(S, np.int64)
    renumber[by_steps] = np.arange(S)
    return Packing(renumber[row_N], start_N, lengths_N, steps_S[by_steps])


def featurize(
    model: MLSTM,
    texts: Sequence[str],
    *,
    batch_size: int | None = 64,
    device: torch.device | None = None,
    on_batch: OnBatch | None = None,
    max_padding: float = MAX_PADDING,
    memory_bytes: int | None = None,
    precision: str = "auto",
    replay: bool | None = None,
) -> np.ndarray:
    """Features [N, H] (float32), one row per text in input order, each text cleaned as the corpus was.

    ``batch_size``: rows read at once; None: as many as fit ``memory_bytes``, by default half the
    device's free memory (``rows_for_memory``). ``max_padding``: the reference recurrence's bound (the
    fused one reads no padding). ``on_batch(texts, bytes)`` after each stretch of reading.
    ``precision``: the products' dtype (``models.precision.feature_precision``): auto is bf16 or fp16
    on a GPU and fp32 on a CPU; bf16 on a CPU that has it in hardware reads about 3× faster at 1,024
    units and more (slower at 64), its features within about 1 % of fp32's. The cell state is kept in
    fp32 either way. ``replay`` (default: on a GPU): the fused path's chunks in which every row reads
    run as one program of static buffers (``_FullChunks``), captured once as a CUDA graph and replayed
    on a GPU, its eager twin elsewhere: the same features, without a launch per kernel per byte.
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not 0 <= max_padding < 1:
        raise ValueError(f"max_padding must be at least 0 and below 1, got {max_padding}")
    device = device or next(model.parameters()).device
    model = model.to(device).eval()
    encoded = [encode(text) for text in texts]
    dtype = feature_precision(precision, device)
    rows_per_batch = batch_size or rows_for_memory(model, device, memory_bytes=memory_bytes, dtype=dtype)
    with autocast(device, dtype):
        if model.recurrence == "fused":
            replay = device.type == "cuda" if replay is None else replay
            return _read_packed(model, encoded, rows_per_batch, device, on_batch, replay=replay, dtype=dtype)
        return _read_length_batches(model, encoded, rows_per_batch, device, on_batch, max_padding)


def _read_packed(
    model: MLSTM,
    encoded: list[bytes],
    rows: int,
    device: torch.device,
    on_batch: OnBatch | None,
    *,
    replay: bool = False,
    dtype: torch.dtype = torch.float32,
) -> np.ndarray:
    """The fused path: texts packed end to end (``pack``), read CHUNK_LEN steps at a time; with
    ``replay``, the chunks where every row reads (all but the last few) through ``_FullChunks``."""
    H = model.config.hidden_size
    features_NH = np.zeros((len(encoded), H), dtype=np.float32)
    if not encoded:
        return features_NH
    packing = pack([len(b) for b in encoded], rows)
    S, T = len(packing.row_steps_S), packing.steps
    # The packed bytes and restart marks on the host, row-major: each text is one contiguous write.
    bytes_ST = np.zeros((S, T), dtype=np.uint8)
    keep_ST = np.ones((S, T), dtype=np.uint8)  # 0 where a text starts: made the state's dtype on the device
    for n, text in enumerate(encoded):
        s, t = packing.row_N[n], packing.start_N[n]
        bytes_ST[s, t : t + len(text)] = np.frombuffer(text, dtype=np.uint8)
        keep_ST[s, t] = 0.0
    end_N = packing.start_N + packing.lengths_N - 1  # the step after which a text's feature is taken
    ending_N = np.argsort(end_N, kind="stable")
    ends_sorted_N = end_N[ending_N]
    c_dtype = model.b.dtype
    state = (torch.zeros(S, H, device=device, dtype=c_dtype), torch.zeros(S, H, device=device, dtype=c_dtype))
    pending: _Stretch | None = None
    # Rows leave only at the end (they are ordered by where they end): the chunks before are full.
    full_chunks = int(packing.row_steps_S[-1]) // CHUNK_LEN if replay else 0
    chunks = _FullChunks(model, S, device, dtype, capture=device.type == "cuda") if full_chunks > 1 else None
    for t0 in range(0, T, CHUNK_LEN):
        t1 = min(T, t0 + CHUNK_LEN)
        reading = packing.reading(t0, t1)
        n0 = reading[0]
        bytes_TN = torch.from_numpy(np.ascontiguousarray(bytes_ST[:n0, t0:t1].T)).to(device).long()
        keep_TN1 = torch.from_numpy(np.ascontiguousarray(keep_ST[:n0, t0:t1].T)).to(device, c_dtype)
        if chunks is not None and t0 < full_chunks * CHUNK_LEN:
            cs: list[Tensor] | Tensor = chunks(bytes_TN, keep_TN1[..., None])
            state = chunks.state
        else:
            if chunks is not None:  # its buffers (and a graph's pool) go before the last chunks' own
                state, chunks = (chunks.state[0].clone(), chunks.state[1].clone()), None
            state, cs = model.read_packed(bytes_TN, keep_TN1[..., None], state, reading)
        lo, hi = np.searchsorted(ends_sorted_N, [t0, t1])
        ids_K = ending_N[lo:hi]  # the texts that end in this stretch, by step
        stretch = _Stretch(
            ids_K, _finals(cs, ends_sorted_N[lo:hi] - t0, packing.row_N[ids_K], device), sum(reading)
        )
        del cs
        # The stretch before went home while this one was queued: the device does not wait for the host.
        if pending is not None:
            pending.collect(features_NH, on_batch)
        pending = stretch
    if pending is not None:
        pending.collect(features_NH, on_batch)
    return features_NH


class _FullChunks:
    """CHUNK_LEN steps in which all ``rows`` read (``MLSTM.read_packed``), as a program of static
    buffers: the chunk's bytes and restart marks in, the state carried from chunk to chunk, every
    step's cell state out ([CHUNK_LEN, rows, H], to be read before the next chunk overwrites it).

    With ``capture`` (a GPU) the first chunk runs eagerly on a side stream (compiling its kernels, as
    capture needs), then the program is captured as a CUDA graph, and every later chunk replays it:
    one launch for a chunk's thousands of kernels, whose launches set the pace at a few hundred rows.
    Without, it runs as it is: the eager twin the CPU tests compare with the plain path."""

    def __init__(self, model: MLSTM, rows: int, device: torch.device, dtype: torch.dtype, *, capture: bool):
        H, c_dtype = model.config.hidden_size, model.b.dtype
        h_dtype = dtype if torch.is_autocast_enabled(device.type) else c_dtype  # as read_packed returns h
        self.model, self.rows, self.device = model, rows, device
        self.bytes_TN = torch.zeros(CHUNK_LEN, rows, dtype=torch.long, device=device)
        self.keep_TN1 = torch.ones(CHUNK_LEN, rows, 1, dtype=c_dtype, device=device)
        self.h_NH = torch.zeros(rows, H, dtype=h_dtype, device=device)
        self.c_NH = torch.zeros(rows, H, dtype=c_dtype, device=device)
        self.cs_TNH = torch.empty(CHUNK_LEN, rows, H, dtype=c_dtype, device=device)
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def state(self) -> tuple[Tensor, Tensor]:
        return self.h_NH, self.c_NH

    def __call__(self, bytes_TN: Tensor, keep_TN1: Tensor) -> Tensor:
        """The next chunk: the cell state after each of its steps."""
        self.bytes_TN.copy_(bytes_TN)
        self.keep_TN1.copy_(keep_TN1)
        if self.graph is not None:
            self.graph.replay()
        elif self.capture:
            self._run_then_capture()
        else:
            self._body()
        return self.cs_TNH

    def _body(self) -> None:
        (h_NH, c_NH), cs = self.model.read_packed(
            self.bytes_TN, self.keep_TN1, (self.h_NH, self.c_NH), [self.rows] * CHUNK_LEN
        )
        torch.stack(cs, out=self.cs_TNH)
        self.h_NH.copy_(h_NH)
        self.c_NH.copy_(c_NH)

    def _run_then_capture(self) -> None:
        """This chunk eagerly on a side stream, then the program captured (capture runs nothing, so the
        state and cell states stay this chunk's)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._body()
        current.wait_stream(side)
        # The eager chunk's temporaries go back to the device: the capture takes its own, in the graph's
        # pool, and the rows were planned for one chunk's (rows_for_memory), not two.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        # Under featurize's autocast, whose cache of parameter casts (the bias's, made by the eager run)
        # lives as long as the graph's replays: all inside one featurize call.
        with torch.cuda.graph(self.graph):
            self._body()


def _finals(
    cs: list[Tensor] | Tensor, steps_K: np.ndarray, rows_K: np.ndarray, device: torch.device
) -> Tensor:
    """The cell states ``cs[steps_K[k]][rows_K[k]]``: with every step as wide, one gather over them all
    (two calls, not two for every step that ends a text)."""
    if len(steps_K) == 0:
        return cs[0].new_zeros((0, cs[0].shape[1]))
    if isinstance(cs, Tensor):  # a full chunk's, already one tensor
        index = torch.from_numpy(np.stack([steps_K, rows_K])).to(device)
        return cs[index[0], index[1]]
    if len({c.shape[0] for c in cs}) == 1:
        index = torch.from_numpy(np.stack([steps_K, rows_K])).to(device)
        return torch.stack(cs)[index[0], index[1]]
    # Rows leave within the stretch (the last stretches): one gather per step that ends a text.
    steps, starts = np.unique(steps_K, return_index=True)
    rows = torch.from_numpy(rows_K).to(device)
    bounds = [*starts.tolist(), len(steps_K)]
    return torch.cat(
        [
            cs[int(t)].index_select(0, rows[a:b])
            for t, a, b in zip(steps, bounds[:-1], bounds[1:], strict=True)
        ]
    )


@dataclasses.dataclass
class _Stretch:
    """The texts that end in one stretch of steps of the packed path, and their features on the way home."""

    ids_K: np.ndarray
    finals_KH: Tensor
    bytes_read: int
    home_KH: Tensor | None = None
    done: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        """Start the copy to the host; on a GPU without waiting for it (pinned memory, an event)."""
        if self.finals_KH.device.type != "cuda":
            self.home_KH = self.finals_KH
            return
        self.home_KH = torch.empty(self.finals_KH.shape, dtype=self.finals_KH.dtype, pin_memory=True)
        self.home_KH.copy_(self.finals_KH, non_blocking=True)
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.done.record()

    def collect(self, features_NH: np.ndarray, on_batch: OnBatch | None) -> None:
        if self.done is not None:
            self.done.synchronize()
        assert self.home_KH is not None
        features_NH[self.ids_K] = self.home_KH.float().numpy()
        if on_batch is not None:
            on_batch(len(self.ids_K), self.bytes_read)


def _read_length_batches(
    model: MLSTM,
    encoded: list[bytes],
    rows_per_batch: int,
    device: torch.device,
    on_batch: OnBatch | None,
    max_padding: float,
) -> np.ndarray:
    """The reference path: batches of similar length, padding masked in ``final_cell_state``."""
    features_NH = np.zeros((len(encoded), model.config.hidden_size), dtype=np.float32)
    for rows in length_batches([len(b) for b in encoded], rows_per_batch, max_padding=max_padding):
        lengths = [len(encoded[r]) for r in rows]
        bytes_BT = np.zeros((len(rows), max(lengths)), dtype=np.int64)
        for b, r in enumerate(rows):
            bytes_BT[b, : lengths[b]] = np.frombuffer(encoded[r], dtype=np.uint8)
        c_BH = model.final_cell_state(
            torch.from_numpy(bytes_BT).to(device), torch.tensor(lengths, device=device)
        )
        features_NH[rows] = c_BH.float().cpu().numpy()
        if on_batch is not None:
            on_batch(len(rows), sum(lengths))
    return features_NH
