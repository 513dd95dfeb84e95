"""How many bytes a training step holds on each GPU at its peak, from the model config alone (no GPU needed).

Per GPU, with P parameters, W ranks, b = B/W rows, T steps (N = b·T), H units, E embedding, V bytes,
and a the compute dtype's size (2 for bf16/fp16, 4 for fp32; f = 4 more under autocast, else 0):

    weights     = 4·P            (÷W under full)             fp32 master weights
    optimizer   = 8·P            (÷W under optimizer, full)  Adam's two moments
    activations = N·(a·(8H + E) + 4·(5H + V) + 8) + a·5·(H² + E·H)    (the fused recurrence)
                | N·(a·(7H + E) + 4·(4H + V) + 8) + a·5·(H² + E·H)    (--recurrence reference, fp32)
                | N·(a·(3H + E) + 4·(12H + V) + 8) + T·a·5H² + a·5·(H² + E·H)   (reference, autocast)
    backward    = 4·(H·V + V) + N·13H·a + 5·H²·(a + f)                (the fused recurrence)
                | 4·(H·V + V) + N·8H·4 + 2·5·H²·4                     (--recurrence reference)
    grads       = 4·P            (÷W under full)
    step        = 4·P            (÷W under full; 0 captured)  the eager foreach Adam's temporaries
    workspace   = 1 GiB + DDP's gradient buckets 4·P and autocast's weight copy a·P (none, optimizer)
                        | the gathered weights a·P and their unsharded gradients 4·P (full)
                  + the capture's copy of the weights and Adam's state 12·P (captured, one GPU)

    total       = weights + optimizer + workspace + max(activations + backward, grads + step)

The step's peak is at the end of the recurrence's backward, where what the forward left (activations)
and the backward's own temporaries (backward) are all alive, and the weights' gradients are not yet
(the fused recurrence makes them in two products at its end); or in the optimizer's step, with every
gradient and Adam's temporaries, where the activations are gone. The larger counts.

activations: what the forward leaves for the backward, per row and step. The fused recurrence
(models/recurrence.py): x W_mx, h, h W_mh, m and x W_x + b in the compute dtype (8H: xz, the input's
share of the four gates, stays alive until the backward has used it) with the byte embedding (E); the
cell state c, the three sigmoid gates and tanh(u) in fp32 (5H: the gate math runs in the state's fp32),
the fp32 log-softmax over V, and the int64 target. The reference cell, through autograd step by step:
h W_mh, m, the three gates, tanh(u) and x W_mx in the compute dtype (7H), c, tanh(c) and h in fp32 and
the stacked h for the read-out (4H); under autocast x W_x + b is fp32, so its gate math runs in fp32 (12H)
and autocast casts W_h and W_mh anew at every step (T·5H², measured on an H200: 40 of a step's 57 GiB
at batch 256). Once per step, the weight-normalised matrices in the compute dtype.

backward: the fused recurrence's backward keeps per step dz (4H), dm ⊙ h W_mh (H) and dhm (H) in
lists, stacks each once at its end (12H), holds the read-out's gradient into h (H), and ends in the two
weight-gradient products dW_h, dW_mh (5H², cast to fp32 under autocast); the read-out's own gradient is
made before it. The reference cell's autograd makes and adds an [H, 4H] and an [H, H] gradient every
step: its figure is approximate (within 15% of the measured peak on CPU, against 1% for the fused one).
The 1 GiB is the CUDA context and the allocator's slack.

`tests/test_memory.py` holds the total, less the 1 GiB, within 10% of the peak of live tensor bytes
measured on CPU over a whole fp32 step (forward, backward, Adam), for the tiny and small presets; a
GPU's ``torch.cuda.max_memory_allocated`` is set beside the planned figure by ``make gpu-check``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from models.mlstm import MLSTMConfig, Recurrence, preset
from tasks.pretrain.sharding import SHARDINGS, Sharding

GiB = 1024**3
CUDA_RESERVE = 1 * GiB
MAX_NODES = 4096


@dataclass(frozen=True)
class PerGpu:
    weights: int
    grads: int
    optimizer: int
    activations: int
    backward: int  # the backward's own temporaries at its peak
    step: int  # the optimizer step's temporaries
    workspace: int

    @property
    def total(self) -> int:
        """The step's peak: the backward's or the optimizer step's, whichever is larger (see the module)."""
        peak = max(self.activations + self.backward, self.grads + self.step)
        return self.weights + self.optimizer + self.workspace + peak

    @property
    def allocated(self) -> int:
        """The tensors' bytes at the peak, without the CUDA context: what ``torch.cuda.max_memory_allocated``
        reports for the same step."""
        return self.total - CUDA_RESERVE


@dataclass(frozen=True)
class MemoryPlan:
    preset: str
    sharding: Sharding
    nodes: int
    gpus_per_node: int
    rows_per_gpu: int
    seq_len: int
    per_gpu: PerGpu
    device_bytes: int
    suggestion: str | None

    @property
    def fits(self) -> bool:
        return self.per_gpu.total <= self.device_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "per_gpu_bytes": {
                **asdict(self.per_gpu),
                "total": self.per_gpu.total,
                "allocated": self.per_gpu.allocated,
            },
            "device_bytes": self.device_bytes,
            "suggestion": self.suggestion,
        }

    def message(self) -> str:
        """One line: what a GPU holds against what it has, and what would fit."""
        gib = {k: v / GiB for k, v in asdict(self.per_gpu).items()}
        world = self.nodes * self.gpus_per_node
        held = (
            f"{self.preset} with --sharding {self.sharding} on {world} GPU(s), {self.rows_per_gpu} rows × "
            f"{self.seq_len} per GPU, needs {self.per_gpu.total / GiB:.1f} GiB per GPU at its peak (weights "
            f"{gib['weights']:.1f}, optimizer {gib['optimizer']:.1f}, workspace {gib['workspace']:.1f}, and "
            f"the larger of activations {gib['activations']:.1f} + backward {gib['backward']:.1f} and grads "
            f"{gib['grads']:.1f} + step {gib['step']:.1f}) of {self.device_bytes / GiB:.0f} GiB"
        )
        if self.fits:
            return f"{held}: fits"
        return f"{held}: does not fit; {self.suggestion}"


def per_gpu_bytes(
    config: MLSTMConfig,
    *,
    sharding: Sharding,
    world_size: int,
    rows: int,
    seq_len: int,
    compute_bytes: int,
    recurrence: Recurrence = "fused",
    graphed: bool = False,
) -> PerGpu:
    """The formula of the module's docstring; ``rows`` is this GPU's share of the batch, ``graphed`` the
    step captured as a CUDA graph (one GPU: fused Adam, and the capture's copy of the state)."""
    P, H, E, V, a = config.num_params, config.hidden_size, config.embed_size, config.vocab_size, compute_bytes
    N = rows * seq_len
    readout_grad = 4 * (H * V + V)
    per_step_weights = 0
    if recurrence == "fused":
        per_step = a * (8 * H + E) + 4 * (5 * H + V) + 8
        backward = readout_grad + N * 13 * H * a + 5 * H * H * (a + (4 if a < 4 else 0))
    elif a < 4:
        # Under autocast x W_x + b is fp32, so the cell's gate math runs in fp32, and autocast casts the
        # (computed, not leaf) recurrent weights anew at every step, each copy kept for the backward.
        per_step = a * (3 * H + E) + 4 * (12 * H + V) + 8
        per_step_weights = seq_len * 5 * H * H * a
        backward = readout_grad + N * 8 * H * 4 + 2 * 5 * H * H * 4
    else:
        per_step = a * (7 * H + E) + 4 * (4 * H + V) + 8
        backward = readout_grad + N * 8 * H * 4 + 2 * 5 * H * H * 4
    full = sharding == "full"  # on one rank too: FSDP2 over a world of one
    shards = world_size if full else 1
    if full:
        workspace = CUDA_RESERVE + a * P + 4 * P
    else:
        workspace = CUDA_RESERVE + (4 * P if world_size > 1 else 0) + (a * P if a < 4 else 0)
    if graphed:  # the capture's snapshot of the weights and Adam's state, alive through its warm-up
        workspace += 12 * P
    return PerGpu(
        weights=math.ceil(4 * P / shards),
        grads=math.ceil(4 * P / shards),
        optimizer=math.ceil(8 * P / (world_size if sharding != "none" else 1)),  # W = 1: whole
        activations=N * per_step + per_step_weights + a * 5 * (H * H + E * H),
        backward=backward,
        step=0 if graphed else math.ceil(4 * P / shards),
        workspace=workspace,
    )


def plan(
    preset_name: str,
    *,
    nodes: int,
    gpus_per_node: int,
    batch_size: int,
    seq_len: int = 256,
    sharding: Sharding = "none",
    gpu_memory_gib: float = 80.0,
    compute_bytes: int = 2,
    recurrence: Recurrence = "fused",
    cuda_graph: bool = True,
) -> MemoryPlan:
    """Whether a launch fits its GPUs and, if not, the smallest change of sharding or nodes that would.
    ``cuda_graph``: the job's --cuda-graph auto, which captures the step of one GPU (not under full)."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(
            f"--nodes {nodes} --gpus-per-node {gpus_per_node}: the planner needs at least one GPU"
        )
    config = preset(preset_name)
    device_bytes = int(gpu_memory_gib * GiB)

    def fits(s: Sharding, n: int) -> PerGpu | None:
        world = n * gpus_per_node
        rows = math.ceil(batch_size / world)
        held = per_gpu_bytes(
            config,
            sharding=s,
            world_size=world,
            rows=rows,
            seq_len=seq_len,
            compute_bytes=compute_bytes,
            recurrence=recurrence,
            graphed=cuda_graph and world == 1 and s != "full",
        )
        return held if held.total <= device_bytes else None

    world = nodes * gpus_per_node
    held = per_gpu_bytes(
        config,
        sharding=sharding,
        world_size=world,
        rows=math.ceil(batch_size / world),
        seq_len=seq_len,
        compute_bytes=compute_bytes,
        recurrence=recurrence,
        graphed=cuda_graph and world == 1 and sharding != "full",
    )
    suggestion = None
    if held.total > device_bytes:
        suggestion = _suggest(fits, sharding, nodes, batch_size, gpus_per_node)
    return MemoryPlan(
        preset_name, sharding, nodes, gpus_per_node, math.ceil(batch_size / world), seq_len, held, device_bytes,
        suggestion,
    )  # fmt: skip


def _suggest(fits: Any, sharding: Sharding, nodes: int, batch_size: int, gpus_per_node: int) -> str:
    # A stronger sharding on the same nodes first (no new hardware), then more nodes.
    for stronger in SHARDINGS[SHARDINGS.index(sharding) + 1 :]:
        if fits(stronger, nodes):
            return f"--sharding {stronger} fits on {nodes} node(s)"
    n = nodes
    while n < MAX_NODES and n * gpus_per_node < batch_size:
        n *= 2
        for s in SHARDINGS[SHARDINGS.index(sharding) :]:
            if fits(s, n):
                return f"--sharding {s} --nodes {n} (× {gpus_per_node} GPUs) fits"
    return "no sharding or node count fits: lower --batch-size or --seq-len"
