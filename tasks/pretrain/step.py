"""One training step of truncated BPTT: the body the eager job runs and the CUDA graph captures.

``device_step`` is the step itself (autocast forward, cross-entropy, the GradScaler's scaling and
unscaling, gradient clipping, Adam, the scaler's update), with nothing in it that waits for the host,
so ``tasks.pretrain.graphed.GraphedStep`` can capture it as it is. ``optimizer_step`` is the eager step
around it: it reads on the host whether fp16 overflow skipped the update and drops the gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from models.mlstm import State
from models.precision import autocast


def device_step(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    inputs: Tensor,
    targets: Tensor,
    state: State,
    *,
    dtype: torch.dtype,
    clip: float,
) -> tuple[Tensor, State, Tensor | None]:
    """One step on the device: the loss, the state to carry on (in the dtype the model returns it), and
    whether the loss scale fell (an fp16 overflow skipped the update), a device tensor; None without a
    loss scale. The gradients it leaves are the caller's to drop."""
    with autocast(inputs.device, dtype):
        logits, (h_BH, c_BH), _ = module(inputs, state)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(parameters, clip)
    # The scale as a tensor: get_scale() would wait for the host.
    scale = scaler._scale.clone() if scaler.is_enabled() and scaler._scale is not None else None
    scaler.step(optimizer)  # fused Adam takes found_inf on the device: an overflow skips
    scaler.update()
    # An overflow makes the scaler skip the update and lower the scale.
    fell = scaler._scale < scale if scale is not None and scaler._scale is not None else None
    return loss.detach(), (h_BH.detach(), c_BH.detach()), fell


def optimizer_step(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    inputs: Tensor,
    targets: Tensor,
    state: State,
    *,
    dtype: torch.dtype,
    clip: float,
) -> tuple[Tensor, State, bool]:
    """One step of truncated BPTT: the loss, the state to carry on, and whether fp16 overflow skipped it."""
    loss, (h_BH, c_BH), fell = device_step(
        module, optimizer, scaler, inputs, targets, state, dtype=dtype, clip=clip
    )
    skipped = fell is not None and bool(fell)
    optimizer.zero_grad(set_to_none=True)
    return loss, (h_BH.float(), c_BH.float()), skipped
