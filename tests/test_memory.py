"""The memory planner: its peak against the bytes a step holds at its peak on CPU, and its refusal of a
launch that cannot fit, with what would, before any process starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import cli_in_process
from torch.nn import functional as F

from models.mlstm import MLSTM, RECURRENCES, Recurrence, preset
from tasks.pretrain.memory import per_gpu_bytes
from tasks.pretrain.sharding import optimizer_state_bytes


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


def peak(name: str, rows: int, seq_len: int, recurrence: Recurrence) -> int:
    """The most tensor bytes alive at once over a whole fp32 training step on CPU (forward, cross-entropy,
    backward, Adam), its second one (Adam's state then exists, as in a run): parameters, gradients, Adam's
    state, what the forward keeps and the backward's own temporaries, each storage once (MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = MLSTM(preset(name), recurrence=recurrence)
    optimizer = torch.optim.Adam(model.parameters())
    data = torch.randint(0, 256, (rows, seq_len + 1))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):
            logits, _, _ = model(data[:, :-1], model.zero_state(rows))
            F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 0:
                tracker.reset_mod_stats()  # the first step creates Adam's state: its peak is not a run's
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return int(snapshot["Total"])


# The fused recurrence (every GPU job's) within 10%; the reference cell (a debugging path), whose autograd
# adds a gradient per step, within 15%.
TOLERANCE = {"fused": 0.10, "reference": 0.15}


@pytest.mark.parametrize("recurrence", RECURRENCES)
@pytest.mark.parametrize(("name", "rows", "seq_len"), [("tiny", 8, 32), ("tiny", 16, 64), ("small", 8, 32)])
def test_the_planned_peak_is_within_ten_percent_of_a_steps_peak_on_cpu(
    name: str, rows: int, seq_len: int, recurrence: Recurrence
) -> None:
    planned = per_gpu_bytes(
        preset(name), sharding="none", world_size=1, rows=rows, seq_len=seq_len, compute_bytes=4,
        recurrence=recurrence,
    )  # fmt: skip
    measured = peak(name, rows, seq_len, recurrence)
    assert planned.allocated == pytest.approx(measured, rel=TOLERANCE[recurrence]), (planned, measured)


@pytest.mark.parametrize("recurrence", RECURRENCES)
def test_the_planners_parts_are_the_bytes_held_on_cpu(recurrence: Recurrence) -> None:
    """Weights, gradients and Adam's state exactly as held; what the backward keeps (saved by autograd
    or on the fused function's context) within 10%: the activations but xz, the input's gate share,
    which is alive at the peak (the test above) though not saved."""
    planned = per_gpu_bytes(
        preset("small"), sharding="none", world_size=1, rows=8, seq_len=32, compute_bytes=4,
        recurrence=recurrence,
    )  # fmt: skip
    held = measured("small", 8, 32, recurrence)
    xz = 8 * 32 * 4 * preset("small").hidden_size * 4 if recurrence == "fused" else 0
    assert (planned.weights, planned.grads, planned.optimizer) == (
        held["weights"],
        held["grads"],
        held["optimizer"],
    )
    assert planned.activations - xz == pytest.approx(held["activations"], rel=0.10)


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
