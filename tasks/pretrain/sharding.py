"""How the job spreads a model over its ranks: ``--sharding none|optimizer|full``.

- ``none``: DDP, every rank holds the weights, gradients and Adam state (today's job).
- ``optimizer``: ZeRO-1 through ``ZeroRedundancyOptimizer``: DDP for the gradients, each rank keeps
  Adam's state of its share of the parameters only.
- ``full``: ZeRO-3 through FSDP2 ``fully_shard``: weights, gradients and Adam state are DTensors
  sharded over the ranks; a forward gathers the weights in the compute dtype (bf16 on GPUs, fp32 on
  CPU) and gradients are reduced in fp32 (FSDP's mixed-precision policy).

Checkpoints stay one consolidated ``state.pt`` (consolidated when saved, on rank 0, through
``torch.distributed.checkpoint.state_dict``): any sharding and any world size resumes from it, and the
transfer stage, ``features``, the registry and the OpenAI import read it unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

Sharding = Literal["none", "optimizer", "full"]
SHARDINGS: tuple[Sharding, ...] = ("none", "optimizer", "full")


def wrap(
    model: nn.Module,
    sharding: Sharding,
    *,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    lr: float,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The module to run forward through and its Adam, for a sharding (plain Adam on one rank)."""
    if world_size == 1:  # nothing to share: the same numbers as any sharding
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    if sharding == "full" and dtype == torch.float16:
        # GradScaler's unscale and skip do not see FSDP2's sharded gradients as one step; not verified.
        raise ValueError(
            "--sharding full with fp16 (--precision fp16, or auto on a GPU without bf16) is not supported: "
            "use --precision bf16 or fp32, or --sharding optimizer"
        )
    if sharding == "full":
        # bf16/fp16 weights in compute, fp32 master weights and reductions: autocast's numbers.
        policy = MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
        )
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if sharding == "optimizer":
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    return ddp, torch.optim.Adam(model.parameters(), lr=lr)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, is_main: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The unsharded weights and optimizer state, whole on rank 0 (every rank must call this)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return model.state_dict(), optimizer.state_dict() if is_main else {}
    if isinstance(model, FSDPModule):
        # The root keeps its weights gathered after a forward without backward (a validation):
        # shard them again, or the state dict holds DTensors instead of whole tensors.
        model.reshard()
        weights = get_model_state_dict(model, options=_FULL)
        state = get_optimizer_state_dict(model, optimizer, options=_FULL)
        return weights, _by_index(state, _names(model)) if is_main else {}
    return model.state_dict(), optimizer.state_dict()


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, Any], state: dict[str, Any]
) -> None:
    """Load a consolidated checkpoint into a model and optimizer of any sharding and world size."""
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer, _by_name(state, _names(model)), options=options)
        return
    model.load_state_dict(weights)
    optimizer.load_state_dict(state)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (a sharded tensor counts its local shard only)."""
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    total = 0
    for values in inner.state.values():
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


# A consolidated checkpoint keeps plain Adam's layout (parameters by index, in the model's order);
# DCP's full state dicts name them (by FQN). These two turn one into the other.
def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {
        "state": {names.index(name): value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names.index(name) for name in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def _by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {
        "state": {names[int(index)]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(index)] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }
