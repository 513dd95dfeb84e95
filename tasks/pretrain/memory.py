"""How many bytes a training step holds on each GPU at its peak, from the model config alone (no GPU needed).

Per GPU, with P parameters, W ranks, b = B/W rows, T steps (N = b·T), H units, E embedding, V bytes,
and a the compute dtype's size (2 for bf16/fp16, 4 for fp32; f = 4 more under autocast, else 0):

    weights     = 4·P            (÷W under full)             fp32 master weights
    optimizer   = 8·P            (÷W under optimizer, full)  Adam's two moments
    grads       = 4·P            (÷W under full)
    activations = N·(a·(4H + V) + 4·(5H + E)) + a·5·(H² + E·H)             (the fused recurrence)
                | N·(4·(11H + E) + a·V) + a·5·(H² + E·H)                    (--recurrence reference, fp32)
                | N·(4·(8H + E) + a·(4H + V)) + T·a·5H² + a·5·E·H          (reference, autocast)
    backward    = max(loss, 4·(H·V + V) + N·13H·a + 5·H²·(a + f))          (the fused recurrence)
                | max(loss + N·a·H, 4·(H·V + V) + N·4H + 13·H²·4, forward)  (reference)
                  loss = N·(12V + 8); forward = N·20H (fp32) | N·(20H + a·H + 4E) + 20·(H² + E·H) + a·H·V
    step        = max(4·P (÷W under full; 0 captured), 32·H²) + N·(20H + a·(H + V))   (fused)
                | max(4·P (÷W under full; 0 captured), 32·H²) + N·(4H + a·V)           (reference)
                  (8·a·H² for 32·H² and f = 0 under full, where FSDP gathers the weights in the compute dtype)
    carried     = 4·b·(T + 1)·H·(2 in fp32, 1 under autocast) + 4·b·H under autocast   (fused, eager)
                | 8·b·H (reference, eager) | 8·b·H + 16·N (captured)
    workspace   = 1 GiB + DDP's gradient buckets 4·P (none, optimizer; more than one rank)
                        | the gathered weights a·P and their unsharded gradients 4·P (full)
                  + the capture's copy of the weights and Adam's state 12·P (captured, one GPU)

    total       = weights + optimizer + carried + workspace + max(activations + backward, grads + step)
    allocated   = total − 1 GiB  (what ``torch.cuda.max_memory_allocated`` reports)

The step's peak is in its backward, where what the forward left (activations) is alive with one of
the backward's own temporaries (backward): at its start, the cross-entropy's log-probabilities, their
gradient and the logits' in fp32 (loss); or at the end of the fused recurrence's backward, with its
per-step gradient lists, their stacks and its two weight-gradient products; or (the reference cell) the
weights' gradients it adds up step by step, or the forward's own end. Else it is after the backward,
with every gradient (grads + step). Terms under 1% of a step are left out (the batch, the initial
state's step in h and c, the gradient of the embedding).

activations: what the forward leaves that stays alive until the recurrence's backward ends. The fused
recurrence (models/recurrence.py): x W_mx, h, h W_mh and m in the compute dtype (4H); the cell state c,
the three sigmoid gates and tanh(u) in fp32 (5H: the gate math runs in the state's fp32); the byte
embedding x (4E: in fp32, or its two casts for the two products under autocast); the logits the caller
holds (a·V); the weight-normalised matrices in the compute dtype. x W_x + b is not kept. The reference
cell, through autograd step by step: the three gates, tanh(u), tanh(c), m, h, x W_mx, h W_mh, c and the
stacked c the caller holds (11H). Under autocast x W_x + b is fp32 (b is), so its gate math runs in
fp32 (8H; m, x W_mx, h W_mh and h's cast for h W_mh in the compute dtype), and autocast casts W_h and
W_mh anew at every step (T·a·5H²: most of such a step's bytes at the paper's size). Autocast
keeps a cast only of a leaf weight (the read-out's, freed with the read-out's backward before the
peak); the cell's matrices are computed, and each product keeps its own cast (counted above).

backward: the fused recurrence's backward keeps per step dz (4H), dm ⊙ h W_mh (H) and dhm (H) in lists
and stacks each once at its end (12H), with the read-out's gradient into h (H) and the read-out's own
(4·(H·V + V)), and ends in the two weight-gradient products dW_h, dW_mh (5H², cast to fp32 under
autocast). The reference cell's autograd holds the read-out's gradient into the stacked h (4H), and up
to three [H, 4H] and one [H, H] fp32 gradients of the recurrent weights in flight as it adds them up;
its forward ends with x W_x + b in fp32 (16H) and the stacked h (4H) alive, and under autocast the fp32
normalised weights, the read-out's cast and h's.

step: after the backward, with every gradient: the eager (foreach) Adam's temporaries (4·P; the captured
step's fused Adam has none) or weight normalisation's backward (two more [H, 4H] fp32), whichever is
larger, while the step's tensors its caller still holds live on: the logits and, for the fused
recurrence, h, c and the per-step gates on the function's context (not saved tensors, so not freed with
them: 16H).

carried: the job (tasks/pretrain/step.py: optimizer_step) carries c, and in fp32 h, as the last step of
the fused forward's [T + 1, b, H] tensors: views, which keep the whole tensors alive through the next
step. The captured step copies them into its own tensors (and the batch into its inputs).

workspace: the 1 GiB is the CUDA context and the allocator's slack. The capture (tasks/pretrain/graphed.py)
snapshots the weights, Adam's state and the scaler's before its warm-up steps and holds them until it is
captured: 12·P on a resumed run (4·P on a fresh one, where Adam's state comes later). torch.cuda.graph
empties the allocator's cache before capturing, and the graph's private pool then keeps the step's
intermediates for good: the same peak as an eager step's.

`tests/test_memory.py` holds the allocated bytes within 10% of the most tensor bytes alive at once over
the job's step on CPU (fp32 and bf16 under autocast, both recurrences); docs/benchmarks.md (Pretraining
step) sets them beside a GPU's ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from models.config import MLSTMConfig, Recurrence, preset
from tasks.jobs.config import SHARDINGS, Sharding

GiB = 1024**3
CUDA_RESERVE = 1 * GiB
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 64
MAX_GPU_MEMORY_GIB = 100_000  # far above any GPU's; an infinite one would make every plan fit


@dataclass(frozen=True)
class PerGpu:
    weights: int
    grads: int
    optimizer: int
    activations: int
    backward: int  # the backward's own temporaries at its peak
    step: int  # alive after the backward, beside the gradients: Adam's temporaries, the step's outputs
    carried: int  # the state carried from one step into the next
    workspace: int

    @property
    def total(self) -> int:
        """The step's peak: the backward's or the optimizer step's, whichever is larger (see the module)."""
        peak = max(self.activations + self.backward, self.grads + self.step)
        return self.weights + self.optimizer + self.carried + self.workspace + peak

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
            f"{gib['weights']:.1f}, optimizer {gib['optimizer']:.1f}, carried {gib['carried']:.1f}, workspace "
            f"{gib['workspace']:.1f}, and "
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
    b, T = rows, seq_len
    N = b * T
    autocast = a < 4
    full = sharding == "full"  # on one rank too: FSDP2 over a world of one
    f = 4 if autocast and not full else 0  # full: FSDP gathers the weights in the compute dtype
    shards = world_size if full else 1
    loss = N * (12 * V + 8)  # log-probabilities, their gradient and the logits' in fp32; the targets
    readout_grad = 4 * (H * V + V)
    if recurrence == "fused":
        activations = N * (a * (4 * H + V) + 4 * (5 * H + E)) + a * 5 * (H * H + E * H)
        backward = max(loss, readout_grad + N * 13 * H * a + 5 * H * H * (a + f))
        outputs = N * (4 * 5 * H + a * (H + V))  # the gates on the function's context, c, h, the logits
        carried = 4 * b * (T + 1) * H * (1 if autocast else 2) + (4 * b * H if autocast else 0)
    else:
        if autocast:
            activations = N * (4 * (8 * H + E) + a * (4 * H + V)) + T * a * 5 * H * H + a * 5 * E * H
            forward_end = N * (20 * H + a * H + 4 * E) + 20 * (H * H + E * H) + a * H * V
        else:
            activations = N * (4 * (11 * H + E) + a * V) + a * 5 * (H * H + E * H)
            forward_end = N * 20 * H
        backward = max(loss + N * a * H, readout_grad + N * 4 * H + 13 * H * H * 4, forward_end)
        outputs = N * (4 * H + a * V)  # the stacked c and the logits
        carried = 8 * b * H
    if graphed:  # the graph's own h, c, inputs and targets, into which the step copies them
        carried = 8 * b * H + 16 * N
    adam = 0 if graphed else math.ceil(4 * P / shards)  # the eager foreach Adam's; fused Adam has none
    gathered = a * P + 4 * P if full else 0  # FSDP's gathered weights and their unsharded gradients
    buckets = 4 * P if world_size > 1 and not full else 0  # DDP's (and ZeRO-1's) gradient buckets
    snapshot = 12 * P if graphed else 0  # the capture's copy of the weights and (resumed) Adam's state
    return PerGpu(
        weights=math.ceil(4 * P / shards),
        grads=math.ceil(4 * P / shards),
        optimizer=math.ceil(8 * P / (world_size if sharding != "none" else 1)),  # W = 1: whole
        activations=activations,
        backward=backward,
        step=max(adam, 8 * H * H * (a if full else 4)) + outputs,  # or weight normalisation's backward
        carried=carried,
        workspace=CUDA_RESERVE + gathered + buckets + snapshot,
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
    if not (1 <= nodes <= MAX_NODES and 1 <= gpus_per_node <= MAX_GPUS_PER_NODE):
        raise ValueError(
            f"--nodes {nodes} --gpus-per-node {gpus_per_node}: the planner takes 1 to {MAX_NODES} nodes "
            f"of 1 to {MAX_GPUS_PER_NODE} GPUs"
        )
    world = nodes * gpus_per_node
    if batch_size % world:  # as the job refuses it: every rank takes the same number of rows
        raise ValueError(
            f"--batch-size {batch_size} is not divisible by {world} ranks: each rank takes batch/ranks rows"
        )
    if not 0 < gpu_memory_gib <= MAX_GPU_MEMORY_GIB:
        raise ValueError(
            f"--gpu-memory {gpu_memory_gib}: give the GiB of one GPU, up to {MAX_GPU_MEMORY_GIB:,}"
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
