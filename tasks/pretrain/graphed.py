"""The training step captured once as a CUDA graph and replayed: one launch per step instead of thousands.

Shapes are static in a run (the batch and seq_len are fixed), so the whole step is captured, the same
``tasks.pretrain.step.device_step`` the eager job runs: autocast forward through the fused recurrence,
cross-entropy, the GradScaler's scaling and unscaling, gradient clipping, Adam (built for the
``captured`` path by ``tasks.jobs.optim``: ``fused=True, capturable=True``, since torch refuses to
capture an Adam without ``capturable``; its learning rate a device tensor the schedule fills in place),
the GradScaler's update, and the carried state copied into the
next step's input. What stays outside, and why:

- the batch: copied into the graph's input tensors before each replay (it comes from the host);
- the learning-rate schedule: ``LambdaLR.step`` runs on the host and ``fill_``s the lr tensor the
  captured Adam reads, so the schedule holds without recapture;
- validation, logging, checkpoints: eager, between replays, on the same parameters;
- skipped fp16 steps: counted on the device inside the graph (the scale fell), read at log time;
- DDP: not captured here; a run of more than one rank trains eagerly (``Trainer`` decides). All-reduce
  inside a graph needs NCCL's graph support and DDP's warm-up rules; measuring it is left for a GPU.

The warm-up that capture needs (a few eager steps on a side stream, so lazy state exists and kernels
are compiled) would move the weights: everything it touches is copied before and put back after, so a
captured run computes the same steps as an eager one and resumes the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.mlstm import State
from tasks.pretrain.step import device_step

WARMUP_STEPS = 3  # eager steps before capture (DDP would need 11; it is not captured here)


def graph_supported(device: torch.device, world_size: int) -> bool:
    """Capture where it can run: a CUDA device and a single rank."""
    return device.type == "cuda" and world_size == 1


class GraphedStep:
    """``tasks.pretrain.step.device_step`` as one CUDA graph. Call it with a batch; the carried state
    lives in ``state`` (the graph's own tensors: read them, or ``set_state`` to replace them)."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        state: State,
        inputs_BT: Tensor,
        targets_BT: Tensor,
        *,
        dtype: torch.dtype,
        clip: float,
    ) -> None:
        for group in optimizer.param_groups:
            if not isinstance(group["lr"], Tensor):
                raise ValueError(
                    "a captured optimizer needs its lr as a device tensor, or the schedule is lost"
                )
            if not group.get("capturable", False):
                raise ValueError("a captured optimizer needs capturable=True (torch refuses to capture it)")
        if inputs_BT.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA device, not {inputs_BT.device}")
        self.module, self.optimizer, self.scaler = module, optimizer, scaler
        self.dtype, self.clip = dtype, clip
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.inputs_BT, self.targets_BT = inputs_BT.clone(), targets_BT.clone()
        self.h_BH, self.c_BH = (t.detach().float().clone() for t in state)
        self.loss = torch.zeros((), device=inputs_BT.device)
        self.skipped = torch.zeros((), device=inputs_BT.device, dtype=torch.int64)
        self.graph = torch.cuda.CUDAGraph()
        self._capture()

    @property
    def state(self) -> State:
        return self.h_BH, self.c_BH

    def set_state(self, state: State) -> None:
        self.h_BH.copy_(state[0])
        self.c_BH.copy_(state[1])

    def __call__(self, inputs_BT: Tensor, targets_BT: Tensor) -> Tensor:
        """One training step on this batch; the loss (a device tensor of its own)."""
        self.inputs_BT.copy_(inputs_BT, non_blocking=True)
        self.targets_BT.copy_(targets_BT, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()

    def _body(self) -> None:
        """The job's step (``device_step``), as captured: it writes into the graph's own tensors."""
        loss, (h_BH, c_BH), fell = device_step(
            self.module,
            self.optimizer,
            self.scaler,
            self.inputs_BT,
            self.targets_BT,
            (self.h_BH, self.c_BH),
            dtype=self.dtype,
            clip=self.clip,
        )
        if fell is not None:
            self.skipped += fell.long()  # counted on the device: reading it would wait for the host
        self.h_BH.copy_(h_BH)
        self.c_BH.copy_(c_BH)
        self.loss.copy_(loss)

    def _snapshot(self) -> list[tuple[Tensor, Tensor]]:
        """Every tensor the warm-up changes, with a copy of its value now."""
        tensors = [*self.parameters, self.h_BH, self.c_BH, self.skipped]
        for value in self.optimizer.state.values():
            tensors += [t for t in value.values() if isinstance(t, Tensor)]
        for name in ("_scale", "_growth_tracker"):
            tensor = getattr(self.scaler, name, None)
            if isinstance(tensor, Tensor):
                tensors.append(tensor)
        return [(t, t.detach().clone()) for t in tensors]

    @torch.no_grad()
    def _restore(self, saved: list[tuple[Tensor, Tensor]]) -> None:
        kept = {id(t) for t, _ in saved}
        for tensor, value in saved:
            tensor.copy_(value)
        # State the warm-up created (Adam's moments and step on a fresh run) starts from zero, as Adam's does.
        for value in self.optimizer.state.values():
            for t in value.values():
                if isinstance(t, Tensor) and id(t) not in kept:
                    t.zero_()
        for name in ("_scale", "_growth_tracker"):
            own = getattr(self.scaler, name, None)
            if isinstance(own, Tensor) and id(own) not in kept:
                raise RuntimeError("GradScaler created its scale during the warm-up: initialise it first")

    def _capture(self) -> None:
        if self.scaler.is_enabled():
            self.scaler.scale(torch.ones((), device=self.inputs_BT.device))  # creates the scale tensor now
        saved = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.optimizer.zero_grad(set_to_none=True)
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self._restore(saved)
        # The backward writes fresh gradients from the graph's pool on every replay (none are accumulated).
        self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self._body()
