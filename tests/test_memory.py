"""The memory planner: its figures against the bytes PyTorch holds on CPU, and its refusal of a launch
that cannot fit, with what would, before any process starts."""

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


@pytest.mark.parametrize("recurrence", RECURRENCES)
@pytest.mark.parametrize(("name", "rows", "seq_len"), [("tiny", 8, 32), ("tiny", 16, 64), ("small", 8, 32)])
def test_the_planner_is_within_ten_percent_of_the_bytes_held_on_cpu(
    name: str, rows: int, seq_len: int, recurrence: Recurrence
) -> None:
    planned = per_gpu_bytes(
        preset(name), sharding="none", world_size=1, rows=rows, seq_len=seq_len, compute_bytes=4,
        recurrence=recurrence,
    )  # fmt: skip
    for part, held in measured(name, rows, seq_len, recurrence).items():
        assert getattr(planned, part) == pytest.approx(held, rel=0.10), (part, getattr(planned, part), held)


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
