"""The one place a training job's optimizer is built: Adam, from the job's ``OptimizerSettings`` and its
learning rate, for each way a step runs.

- ``eager``: plain Adam: on one rank, under DDP, and under FSDP2 (whose parameters are DTensors).
- ``captured``: the Adam a CUDA graph replays (tasks/pretrain/graphed.py): its lr a device tensor the
  schedule fills in place (a float would be baked into the graph), fused, so that an fp16 overflow step
  is skipped on the device without asking the host, and capturable, or torch refuses to capture it.
- ``zero``: ZeRO-1, ``ZeroRedundancyOptimizer`` around the same Adam: each rank keeps Adam's state of
  its share of the parameters.

Every path passes Adam the same hyperparameters: the learning rate, and each field of
``OptimizerSettings`` as Adam's keyword of the same name.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.optim.optimizer import ParamsT

from tasks.jobs.config import OptimizerSettings

OptimizerPath = Literal["eager", "captured", "zero"]


def adam_options(settings: OptimizerSettings) -> dict[str, Any]:
    """Adam's keywords from a job's settings, besides lr: each field of ``OptimizerSettings``, by name."""
    return settings.model_dump(include=set(OptimizerSettings.model_fields))


def build_optimizer(
    params: ParamsT, settings: OptimizerSettings, *, lr: float, path: OptimizerPath = "eager"
) -> torch.optim.Optimizer:
    """Adam over ``params`` (parameters, or param groups with their own lr) at ``lr``, for ``path``."""
    options = adam_options(settings)
    if path == "zero":
        # Imported here: torch.distributed.optim takes about 0.3 s, which no unsharded rank needs.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr, **options)
    if path == "captured":
        listed: list[Any] = list(params)
        first = listed[0]["params"][0] if isinstance(listed[0], dict) else listed[0]
        assert isinstance(first, torch.Tensor), "a captured Adam takes parameters or param groups"
        return torch.optim.Adam(
            listed,
            lr=torch.tensor(lr, device=first.device),
            fused=True,
            capturable=True,  # or Adam refuses to be captured
            **options,
        )
    return torch.optim.Adam(params, lr=lr, **options)
