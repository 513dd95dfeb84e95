"""The memory planner: its peak against the bytes the job's step holds at its peak on CPU, and its refusal
of a launch that cannot fit, with what would, before any process starts."""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import cli_in_process
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from models.mlstm import MLSTM, RECURRENCES, Recurrence, preset
from tasks.jobs.sharding import optimizer_state_bytes
from tasks.pretrain.memory import per_gpu_bytes
from tasks.pretrain.step import optimizer_step


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages alive, and the most at once: a storage counts once, however many
    tensors view it, from the op that makes it (or ``track``) until its last reference goes (a weak
    reference's callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.live = self.peak = 0

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self.sizes:
            self.sizes[key] = storage.nbytes()
            self.refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)

    def _freed(self, key: int, _: object) -> None:
        self.live -= self.sizes.pop(key)
        del self.refs[key]

    def __torch_dispatch__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


def peak(
    name: str, rows: int, seq_len: int, recurrence: Recurrence, dtype: torch.dtype = torch.float32
) -> int:
    """The most tensor bytes alive at once over the job's training step on CPU (tasks.pretrain.step.
    optimizer_step: forward, cross-entropy, backward, clipping, Adam), its second, with the state the first
    carried and Adam's state, as in a run: parameters, gradients, Adam's state, the carried state, what
    the forward keeps and the backward's own temporaries."""
    torch.manual_seed(0)
    model = MLSTM(preset(name), recurrence=recurrence)
    # foreach, as Adam runs on a GPU (on a CPU its default is a per-tensor loop, with other temporaries)
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    bytes_BT = torch.randint(0, 256, (rows, seq_len + 1))
    args = (model, optimizer, scaler, bytes_BT[:, :-1], bytes_BT[:, 1:])
    _, state, _ = optimizer_step(*args, model.zero_state(rows), dtype=dtype, clip=1.0)
    live = LiveBytes()
    for tensor in [*model.parameters(), *state, *(t for s in optimizer.state.values() for t in s.values())]:
        live.track(tensor)
    with live:
        optimizer_step(*args, state, dtype=dtype, clip=1.0)
    return live.peak


def test_the_live_bytes_are_the_cpu_allocators() -> None:
    """LiveBytes's peak is the CPU allocator's, from the profiler's record of every allocation and free:
    the bytes that peak() measures are the bytes the step holds (MemTracker's, over two steps, held an
    [N, 4H] tensor more than the allocator did)."""
    torch.manual_seed(0)
    model = MLSTM(preset("tiny"))
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    bytes_BT = torch.randint(0, 256, (16, 65))
    args = (model, optimizer, scaler, bytes_BT[:, :-1], bytes_BT[:, 1:])
    _, state, _ = optimizer_step(*args, model.zero_state(16), dtype=torch.float32, clip=1.0)
    live = LiveBytes()
    for tensor in [
        *model.parameters(),
        *state,
        bytes_BT,
        *(t for s in optimizer.state.values() for t in s.values()),
    ]:
        live.track(tensor)
    before = live.live  # the allocator's record starts from nothing: what was made before is no event
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof, live:
        optimizer_step(*args, state, dtype=torch.float32, clip=1.0)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = most = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        most = max(most, held)
    assert live.peak - before == pytest.approx(most, rel=0.01), (live.peak - before, most)


@pytest.mark.parametrize("recurrence", RECURRENCES)
@pytest.mark.parametrize(
    ("name", "rows", "seq_len", "dtype"),
    [
        ("tiny", 8, 32, torch.float32),
        ("tiny", 16, 64, torch.float32),
        ("small", 8, 32, torch.float32),
        ("small", 32, 64, torch.float32),  # activations over weights and Adam's state
        ("tiny", 16, 64, torch.bfloat16),  # the compute dtype's two bytes (CPU autocast)
        ("small", 16, 32, torch.bfloat16),
    ],
)
def test_the_planned_peak_is_within_ten_percent_of_a_steps_peak_on_cpu(
    name: str, rows: int, seq_len: int, dtype: torch.dtype, recurrence: Recurrence
) -> None:
    planned = per_gpu_bytes(
        preset(name), sharding="none", world_size=1, rows=rows, seq_len=seq_len, compute_bytes=dtype.itemsize,
        recurrence=recurrence,
    )  # fmt: skip
    held = peak(name, rows, seq_len, recurrence, dtype)
    assert planned.allocated == pytest.approx(held, rel=0.10), (planned, held)


def measured(name: str, rows: int, seq_len: int, recurrence: Recurrence) -> dict[str, int]:
    """Bytes of one fp32 training step on CPU: parameters, gradients, Adam's state, and what the
    backward pass keeps (each storage once, parameters left out): what autograd saves, and the tensors
    a custom autograd function holds on its context (the fused recurrence's per-step gates)."""
    torch.manual_seed(0)
    model = MLSTM(preset(name), recurrence=recurrence)
    optimizer = torch.optim.Adam(model.parameters())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    data = torch.randint(0, 256, (rows, seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits, _, _ = model(data[:, :-1], model.zero_state(rows))
        loss = F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
    nodes, seen = [loss.grad_fn], set()
    while nodes:  # the graph's nodes: a custom function's node is its context
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for held in getattr(node, "gates", ()):
            for tensor in held:
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        nodes.extend(next_node for next_node, _ in node.next_functions)
    loss.backward()
    optimizer.step()
    return {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": sum(
            p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
        ),
        "optimizer": optimizer_state_bytes(optimizer),
        "activations": sum(saved.values()),
    }


@pytest.mark.parametrize("recurrence", RECURRENCES)
def test_the_planners_parts_are_the_bytes_held_on_cpu(recurrence: Recurrence) -> None:
    """Weights, gradients and Adam's state exactly as held; the activations within 10% of what the
    backward keeps (saved by autograd or on the fused function's context): in fp32 the log-probabilities
    it saves, freed before the recurrence's backward, weigh what the logits the caller holds do."""
    planned = per_gpu_bytes(
        preset("small"), sharding="none", world_size=1, rows=8, seq_len=32, compute_bytes=4,
        recurrence=recurrence,
    )  # fmt: skip
    held = measured("small", 8, 32, recurrence)
    assert (planned.weights, planned.grads, planned.optimizer) == (
        held["weights"],
        held["grads"],
        held["optimizer"],
    )
    assert planned.activations == pytest.approx(held["activations"], rel=0.10)


def test_the_planner_refuses_an_oversized_preset_with_what_would_fit() -> None:
    args = ["plan", "--preset", "large_32768", "--batch-size", "32", "--gpu-memory", "80", "--json"]
    result = cli_in_process(args)
    assert result.returncode == 1, result.stderr
    plan = json.loads(result.stdout)
    assert plan["fits"] is False and plan["device_bytes"] == 80 * 1024**3
    assert (
        plan["per_gpu_bytes"]["weights"] + plan["per_gpu_bytes"]["grads"] + plan["per_gpu_bytes"]["optimizer"]
        > 80e9
    )
    suggested = re.match(r"--sharding full --nodes (\d+) ", plan["suggestion"])
    assert suggested, plan["suggestion"]
    nodes = suggested.group(1)
    fitted = cli_in_process([*args[:-1], "--sharding", "full", "--nodes", nodes])
    assert fitted.returncode == 0 and "fits" in fitted.stdout, fitted.stdout + fitted.stderr
    # The smallest power of two: half as many nodes do not fit.
    fewer = cli_in_process([*args[:-1], "--sharding", "full", "--nodes", str(int(nodes) // 2)])
    assert fewer.returncode == 1, fewer.stdout


def test_pretrain_refuses_a_launch_that_cannot_fit_before_any_process_starts(
    sample_manifest: str, home: Path
) -> None:
    args = ["pretrain", "--corpus", sample_manifest, "--preset", "large_32768", "--gpus-per-node", "1"]
    result = cli_in_process([*args, "--batch-size", "8", "--seq-len", "32"])
    assert result.returncode == 2
    assert "does not fit" in result.stderr and "--sharding full --nodes " in result.stderr, result.stderr
    assert not (home / "jobs").exists()  # no job folder: nothing was launched
