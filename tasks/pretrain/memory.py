"""How many bytes a training step holds on each GPU, from the model config alone (no GPU needed).

Per GPU, with P parameters, W ranks, b = B/W rows, T steps, H units, E embedding, V bytes, and a
the compute dtype's size (2 for bf16/fp16, 4 for fp32):

    weights     = 4·P            (÷W under full)             fp32 master weights
    grads       = 4·P            (÷W under full)
    optimizer   = 8·P            (÷W under optimizer, full)  Adam's two moments
    activations = b·T·(a·(4H + E) + 4·(5H + V) + 8) + a·5·(H² + E·H)    (the fused recurrence)
                | b·T·(a·(7H + E) + 4·(4H + V) + 8) + a·5·(H² + E·H)    (--recurrence reference)
    workspace   = 1 GiB + DDP's gradient buckets 4·P and autocast's weight copy a·P (none, optimizer)
                        | the gathered weights a·P and their unsharded gradients 4·P (full)

The activations are what the backward pass keeps, per row and step. The fused recurrence
(models/recurrence.py): x W_mx, h, h W_mh and m in the compute dtype (4H) with the byte embedding (E);
the cell state c, the three sigmoid gates and tanh(u) in fp32 (5H: the gate math runs in the state's
fp32), the fp32 log-softmax over V, and the int64 target. The reference cell, through autograd step by
step: h W_mh, m, the three gates, tanh(u) and x W_mx in the compute dtype (7H), c, tanh(c) and h in fp32
and the stacked h for the read-out (4H). Once per step, the weight-normalised matrices in the compute
dtype. The 1 GiB is the CUDA context and the allocator's slack. `tests/test_memory.py` checks the first
four against the bytes PyTorch holds on CPU, for both recurrences.
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
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.workspace


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
            "per_gpu_bytes": {**asdict(self.per_gpu), "total": self.per_gpu.total},
            "device_bytes": self.device_bytes,
            "suggestion": self.suggestion,
        }

    def message(self) -> str:
        """One line: what a GPU holds against what it has, and what would fit."""
        gib = {k: v / GiB for k, v in asdict(self.per_gpu).items()}
        world = self.nodes * self.gpus_per_node
        held = (
            f"{self.preset} with --sharding {self.sharding} on {world} GPU(s), {self.rows_per_gpu} rows × "
            f"{self.seq_len} per GPU, needs {self.per_gpu.total / GiB:.1f} GiB per GPU (weights "
            f"{gib['weights']:.1f}, grads {gib['grads']:.1f}, optimizer {gib['optimizer']:.1f}, activations "
            f"{gib['activations']:.1f}, workspace {gib['workspace']:.1f}) of {self.device_bytes / GiB:.0f} GiB"
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
) -> PerGpu:
    """The formula of the module's docstring; ``rows`` is this GPU's share of the batch."""
    P, H, E, V, a = config.num_params, config.hidden_size, config.embed_size, config.vocab_size, compute_bytes
    if recurrence == "fused":
        per_step = a * (4 * H + E) + 4 * (5 * H + V) + 8
    else:
        per_step = a * (7 * H + E) + 4 * (4 * H + V) + 8
    full = sharding == "full" and world_size > 1  # one rank runs unwrapped, whatever the sharding
    shards = world_size if full else 1
    if full:
        workspace = CUDA_RESERVE + a * P + 4 * P
    else:
        workspace = CUDA_RESERVE + (4 * P if world_size > 1 else 0) + (a * P if a < 4 else 0)
    return PerGpu(
        weights=math.ceil(4 * P / shards),
        grads=math.ceil(4 * P / shards),
        optimizer=math.ceil(8 * P / (world_size if sharding != "none" else 1)),  # W = 1: whole
        activations=rows * seq_len * per_step + a * 5 * (H * H + E * H),
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
) -> MemoryPlan:
    """Whether a launch fits its GPUs and, if not, the smallest change of sharding or nodes that would."""
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
