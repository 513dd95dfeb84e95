"""What ``benchmarks/pretrain.py`` measures on a device: one row's timed training steps, and the tools.

The device's clock, memory and matmul peak (``synchronize``, ``release_memory``, ``peak_memory``,
``matmul_peak``), a row's record (``Row``) and how it is taken (``train_row``: warm-up, timed steps,
peak memory, the planned peak, the parity check), and one step under torch.profiler (``profile_step``).
The command (its arguments, the utilisation, goals and report) stays in ``benchmarks/pretrain.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import profile_table, say, synchronize  # the working tree on the path
from pretrain_models import IMPLEMENTATIONS

from models.mlstm import MLSTM, MLSTMConfig, preset
from models.precision import PRECISION_NAMES
from tasks.jobs.config import OptimizerSettings
from tasks.jobs.optim import build_optimizer
from tasks.pretrain.config import TrainConfig
from tasks.pretrain.graphed import GraphedStep
from tasks.pretrain.memory import per_gpu_bytes
from tasks.pretrain.step import optimizer_step

# 3 epochs × 40 GB of Amazon reviews in 4 hours on 128 V100s: 120e9 / 14,400 s / 128 ≈ 65k chars/s.
PAPER_CHARS_PER_S = 65_000
# The job's defaults: the rate does not change a step's cost, but clipping is part of the step.
LR: float = TrainConfig.model_fields["lr"].default
CLIP: float = TrainConfig.model_fields["clip"].default
DTYPE_NAMES = PRECISION_NAMES  # the names the job reads measured peaks by


# ---------------------------------------------------------------------------------------------
# Device, memory and the matmul peak


def release_memory(device: torch.device) -> None:
    """Hand freed memory back, so one row's leftovers do not count in the next row's peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        # glibc keeps freed blocks under its mmap threshold (up to 32 MiB) in the heap, still resident.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Writing 5 to clear_refs resets VmHWM (Linux ≥ 4.0); without it the peak is the process's lifetime.
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as stream:
        stream.write("5")


def peak_memory(device: torch.device) -> int:
    """Bytes: the CUDA caching allocator's peak on a GPU, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with contextlib.suppress(OSError), open("/proc/self/status") as stream:
        for line in stream:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def matmul_peak(dtype: torch.dtype, device: torch.device, size: int) -> float:
    """FLOP/s of the fastest of several timed [size, size] @ [size, size] products."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    # A GPU product takes about a millisecond: time a batch of them, so launch and sync do not count.
    per_timing, timings = (20, 10) if device.type == "cuda" else (1, 3)
    for _ in range(2):
        a @ b
    best = math.inf
    for _ in range(timings):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(per_timing):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / per_timing)
    return 2 * size**3 / best


# ---------------------------------------------------------------------------------------------
# Measurements


@dataclass
class Row:
    preset: str
    impl: str  # a key of IMPLEMENTATIONS
    num_params: int
    batch: int
    seq_len: int
    precision: str
    status: str = "ok"  # or "out of memory"
    step_seconds: list[float] = field(default_factory=list)
    chars_per_s: float | None = None
    mfu: float | None = None  # against the measured peak of the precision used
    mfu_vs_bf16_peak: float | None = None
    mfu_vs_datasheet: float | None = None  # tasks.pretrain.metrics.GPU_PEAK_FLOPS, on a GPU it knows
    vs_baseline: float | None = None  # chars/s over the baseline's at the same preset, batch, precision
    vs_reference: float | None = None  # chars/s over the reference recurrence's (graphed, fused rows)
    vs_paper: float | None = None  # chars/s over PAPER_CHARS_PER_S
    peak_memory_bytes: int = 0
    # tasks.pretrain.memory's planned peak for this row's step, without the CUDA context (the mLSTM rows)
    planned_allocated_bytes: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    parity_max_abs_diff: float | None = None  # reference, baseline: its logits against the fused forward's


@torch.no_grad()
def fused_difference(model: MLSTM) -> float:
    """Largest |logit| difference between the fused forward and the model's own, on its weights, in fp32."""
    bytes_BT = torch.randint(0, 256, (2, 8), device=model.b.device)
    fused = MLSTM(model.config).to(model.b.device)
    fused.load_state_dict(model.state_dict())
    return (fused(bytes_BT)[0] - model(bytes_BT)[0]).abs().max().item()


def train_row(
    name: str, impl: str, batch: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> Row:
    config: MLSTMConfig = preset(name)
    release_memory(device)
    reset_peak_memory(device)
    torch.manual_seed(0)  # every mLSTM row of a preset starts from the same weights, on any device
    model = IMPLEMENTATIONS[impl](config).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    row = Row(name, impl, num_params, batch, args.seq_len, DTYPE_NAMES[dtype])
    # The job's Adam, for a captured step (lr a device tensor the schedule fills, fused, capturable) or not.
    path = "captured" if impl == "graphed" else "eager"
    optimizer = build_optimizer(model.parameters(), OptimizerSettings(), lr=LR, path=path)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    state = model.zero_state(batch, device=device)
    torch.manual_seed(1)  # and see the same batches
    losses = []
    graph: GraphedStep | None = None
    try:
        for step in range(args.warmup + args.steps):
            bytes_BT = torch.randint(0, 256, (batch, args.seq_len + 1), device=device)
            if impl == "graphed" and graph is None:  # warm-up and capture, outside the clock
                graph = GraphedStep(
                    model, optimizer, scaler, state, bytes_BT[:, :-1], bytes_BT[:, 1:], dtype=dtype, clip=CLIP
                )
            synchronize(device)
            started = time.perf_counter()
            if graph is not None:
                loss = graph(bytes_BT[:, :-1], bytes_BT[:, 1:])  # the state carries inside the graph
            else:
                loss, state, _ = optimizer_step(
                    model, optimizer, scaler, bytes_BT[:, :-1], bytes_BT[:, 1:], state, dtype=dtype, clip=CLIP
                )
            synchronize(device)
            seconds = time.perf_counter() - started
            losses.append(loss.item())  # after the clock: .item() waits for the device
            if step >= args.warmup:
                row.step_seconds.append(seconds)
            say(f"  {name} {impl} step {step + 1}/{args.warmup + args.steps}: {seconds:.3f} s")
    except torch.OutOfMemoryError:
        row.status = "out of memory"
    row.peak_memory_bytes = peak_memory(device)
    if isinstance(model, MLSTM) and impl != "baseline":
        row.planned_allocated_bytes = per_gpu_bytes(
            config,
            sharding="none",
            world_size=1,
            rows=batch,
            seq_len=args.seq_len,
            compute_bytes=dtype.itemsize,
            recurrence=model.recurrence,
            graphed=impl == "graphed",
        ).allocated
    if losses:
        row.first_loss, row.last_loss = losses[0], losses[-1]
    if row.step_seconds:
        row.chars_per_s = batch * args.seq_len * len(row.step_seconds) / sum(row.step_seconds)
        row.vs_paper = row.chars_per_s / PAPER_CHARS_PER_S
    if impl in ("reference", "baseline") and row.status == "ok" and isinstance(model, MLSTM):
        row.parity_max_abs_diff = fused_difference(model)
    del model, optimizer, scaler, state, graph  # the graph holds its memory pool until it goes
    release_memory(device)
    return row


def profile_step(
    name: str,
    impl: str,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    path: Path,
) -> None:
    """One step of ``impl`` under torch.profiler, after a warm-up one; its operators by device time to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    release_memory(device)
    torch.manual_seed(0)
    model = IMPLEMENTATIONS[impl](preset(name)).to(device)
    graphed = impl == "graphed"
    optimizer = build_optimizer(
        model.parameters(), OptimizerSettings(), lr=LR, path="captured" if graphed else "eager"
    )
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    state = model.zero_state(batch, device=device)
    bytes_BT = torch.randint(0, 256, (batch, args.seq_len + 1), device=device)
    inputs, targets = bytes_BT[:, :-1], bytes_BT[:, 1:]
    graph = (
        GraphedStep(model, optimizer, scaler, state, inputs, targets, dtype=dtype, clip=CLIP)
        if graphed
        else None
    )

    def step() -> None:
        nonlocal state
        if graph is not None:
            graph(inputs, targets)
        else:
            _, state, _ = optimizer_step(
                model, optimizer, scaler, inputs, targets, state, dtype=dtype, clip=CLIP
            )
        synchronize(device)

    step()  # warm: compilation and the allocator stay out of the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    started = time.perf_counter()
    with profile(activities=activities) as profiler:
        step()
    seconds = time.perf_counter() - started
    text = profile_table(profiler, device)
    header = f"{name} {impl}, batch {batch} × {args.seq_len}, {DTYPE_NAMES[dtype]} on {device}: one step {seconds:.3f} s (profiled)"
    path.write_text(header + "\n" + text + "\n")
    say(f"profile of one step written to {path}")
