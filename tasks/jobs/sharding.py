"""How the job spreads a model over its ranks: ``--sharding none|optimizer|full``.

- ``none``: DDP, every rank holds the weights, gradients and Adam state (today's job).
- ``optimizer``: ZeRO-1 through ``ZeroRedundancyOptimizer``: DDP for the gradients, each rank keeps
  Adam's state of its share of the parameters only.
- ``full``: ZeRO-3 through FSDP2 ``fully_shard``: weights, gradients and Adam state are DTensors
  sharded over the ranks; a forward gathers the weights in the compute dtype (bf16 on GPUs, fp32 on
  CPU) and gradients are reduced in fp32 (FSDP's mixed-precision policy). On one rank too: a world of
  one saves no memory, but runs the many-rank code and writes its DCP checkpoints (no CUDA graph).

Checkpoints: where the state is sharded (``optimizer`` on more than one rank, or ``full``), each rank
saves its own share through ``torch.distributed.checkpoint`` (DCP): nothing is gathered on one rank,
and a resume at any world size and any sharding loads the files, DCP resharding them
(``save_sharded``, ``load_sharded``). ``none`` and one rank keep one consolidated ``state.pt``
(``full_state``, ``load_full_state``), which any sharding also resumes from. The transfer stage,
``features``, the registry and ``explain`` read a consolidated ``state.pt``: a sharded checkpoint is
consolidated on first use (``consolidate``, in one process) and cached beside its DCP files
(tasks/jobs/checkpoint.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tasks.jobs.config import OptimizerSettings, Sharding
from tasks.jobs.optim import OptimizerPath, build_optimizer

# FSDP2, DCP and ZeRO are imported where a sharded launch uses them: together about 1.2 s of every rank's
# start (DTensor's import pulls in sympy), which an unsharded launch (DDP or one rank) never needs.
if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


def _is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by ``fully_shard``: never, if this process has not imported FSDP."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def _zero(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer | None:
    """The ZeRO optimizer ``optimizer`` is, or None (always, if this process has not imported ZeRO)."""
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer
    return None


def wrap(
    model: nn.Module,
    sharding: Sharding,
    *,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    optimizer: OptimizerSettings,
    lr: float,
    params: Callable[[nn.Module], Any] = nn.Module.parameters,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The module to run forward through and its Adam (``tasks.jobs.optim``, from the job's ``optimizer``
    settings at ``lr``), for a sharding. On one rank ``none`` and ``optimizer`` are plain Adam (nothing to
    share: the same numbers); ``full`` is FSDP2 over a world of one, so that the many-rank code and its
    DCP checkpoints run, and resume, on one GPU too. ``params``: what Adam updates (its parameters, or
    param groups with their own lr), read from the model after it is sharded (FSDP2 puts DTensors in
    place of its parameters)."""
    if world_size == 1 and sharding != "full":
        return model, build_optimizer(params(model), optimizer, lr=lr)
    if sharding == "full" and dtype == torch.float16:
        # GradScaler's unscale and skip do not see FSDP2's sharded gradients as one step; not verified.
        raise ValueError(
            "--sharding full with fp16 (--precision fp16, or auto on a GPU without bf16) is not supported: "
            "use --precision bf16 or fp32, or --sharding optimizer"
        )
    if sharding == "full" and not dist.is_initialized():
        raise ValueError(
            "--sharding full needs a process group, even on one rank: launch it through torchrun"
        )
    if sharding == "full":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16/fp16 weights in compute, fp32 master weights and reductions: autocast's numbers.
        policy = MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
        )
        fully_shard(model, mp_policy=policy)
        return model, build_optimizer(params(model), optimizer, lr=lr)
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    path: OptimizerPath = "zero" if sharding == "optimizer" else "eager"
    return ddp, build_optimizer(params(model), optimizer, lr=lr, path=path)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The weights and Adam state of an unsharded launch (DDP or one rank), for one ``state.pt``;
    a sharded one saves through DCP instead (``save_sharded``): nothing is gathered on one rank."""
    assert not is_sharded(model, optimizer), "a sharded state is saved with save_sharded"
    return model.state_dict(), optimizer.state_dict()


def load_full_weights(model: nn.Module, weights: dict[str, Any]) -> None:
    """Load consolidated weights alone (Adam keeps its own, empty state) into a model of any sharding."""
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
        return
    model.load_state_dict(weights)


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, Any], state: dict[str, Any]
) -> None:
    """Load a consolidated checkpoint into a model and optimizer of any sharding and world size."""
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer, _by_name(state, _names(model)), options=options)
        return
    model.load_state_dict(weights)
    optimizer.load_state_dict(state)


def is_sharded(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether no rank holds the whole state: its checkpoint is then saved sharded, through DCP."""
    return _zero(optimizer) is not None or _is_fsdp(model)


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[Any]]:
    """This rank's share, as DCP saves and loads it: the weights by name (DTensors under ``full``)
    and Adam's state by parameter name (under ``optimizer``, only the parameters this rank updates);
    and this rank's param groups (by name), which stay out of the files: they differ between ranks
    under ZeRO, and the hyperparameters come from the launch (lr from the schedule)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if _is_fsdp(model):
        # The root keeps its weights gathered after a forward without backward (a validation):
        # shard them again, or the state dict holds whole tensors instead of DTensors.
        model.reshard()  # type: ignore[operator]
    inner = zero.optim if (zero := _zero(optimizer)) else optimizer
    adam = get_optimizer_state_dict(model, inner)  # allocates Adam's state (zeros) if there is none yet
    groups: list[Any] = list(adam["param_groups"])
    return {"model": get_model_state_dict(model), "optimizer": adam["state"]}, groups


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank writes its share into ``directory`` (one per rank, or shared); rank 0 also the
    ``.metadata`` that says where every piece is. Every rank must call this."""
    import torch.distributed.checkpoint as dcp

    state, _ = _sharded_state(model, optimizer)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load DCP files saved at any world size and sharding into this launch's model and optimizer.
    Every rank must call this."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from tasks.jobs.dcp_reader import load_into

    state, groups = _sharded_state(model, optimizer)
    load_into(state, directory)  # the index and any stored bytes read as data only
    set_model_state_dict(model, state["model"])
    inner = zero.optim if (zero := _zero(optimizer)) else optimizer
    set_optimizer_state_dict(model, inner, {"state": state["optimizer"], "param_groups": groups})


def optimizer_layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a consolidated checkpoint needs beside the DCP files: the parameters' names in the model's
    order and Adam's param groups as plain Adam saves them (parameters by index, lr a number)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    groups = [
        {
            **{k: float(v) if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"},
            "params": [index[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return {"param_names": _names(model), "param_groups": groups}


def consolidate(directory: Path, run_state: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's DCP files and ``run_state.pt`` as one ``state.pt``'s state (no process
    group: one process reads every file)."""
    from tasks.jobs.dcp_reader import read_whole

    saved = read_whole(directory)  # DCP's own dcp_to_torch_save reads the index with a plain pickle
    names = run_state["param_names"]  # the model's order, which plain Adam's indices follow
    weights = {name: saved["model"][name] for name in names}
    adam = {names.index(name): value for name, value in saved["optimizer"].items()}
    rest = {k: v for k, v in run_state.items() if k not in ("param_groups", "param_names")}
    return {"model": weights, "optimizer": {"state": adam, "param_groups": run_state["param_groups"]}, **rest}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (a sharded tensor counts its local shard only)."""
    inner = zero.optim if (zero := _zero(optimizer)) else optimizer
    total = 0
    for values in inner.state.values():
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


# A consolidated checkpoint keeps plain Adam's layout (parameters by index, in the model's order);
# DCP's state dicts name them (by FQN): ``_by_name`` turns the first into the second.
def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {
        "state": {names[int(index)]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(index)] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }
