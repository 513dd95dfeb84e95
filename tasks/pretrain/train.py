"""The pretraining job: ``torchrun --nproc-per-node N -m tasks.pretrain.train --corpus URI --preset NAME --run-name NAME``.

The same code on one CPU, one GPU, 8 GPUs or 16 nodes × 8: rank and world size come from torchrun's
environment, DDP averages gradients, autocast gives mixed precision (bf16 where the GPU has it, fp16
with a dynamic loss scale where it does not, fp32 on CPU or on request). Data follows DESIGN.md: the
train split is one byte stream, the global batch has B contiguous rows, the hidden state carries from
step to step (truncated BPTT), and where a step reads is a function of the step alone, so a relaunch
with the same ``--run-name`` resumes from ``latest.json`` exactly, with any number of ranks.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from models.mlstm import MLSTM, State, preset
from tasks.pretrain import checkpoint, joblog
from tasks.pretrain import sharding as shard
from tasks.pretrain.config import RUN_FIELDS, Precision, TrainConfig
from tasks.pretrain.graphed import GraphedStep, graph_supported
from tasks.pretrain.stream import BatchPlan, ByteStream, StreamError, open_split
from tasks.pretrain.torchrun import die_with_parent
from tasks.settings import Settings, get_settings
from tasks.store import Store, open_store, split_object_uri

# Dense bf16 tensor-core peaks (FLOP/s) of GPUs by name, for model FLOPs utilisation against the datasheet.
# The `mfu` metric uses a measured peak where one is known (MLSTM_PEAK_FLOPS, or the file
# benchmarks/pretrain.py writes on a GPU, MEASURED_PEAKS under MLSTM_HOME); the datasheet's stays beside it.
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
}


def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The papers' schedule: linear warm-up, then linear decay to zero at the end of the run."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    return warmup * max(0.0, 1.0 - step / total_steps)


def plain_lr(value: Any) -> Any:
    """``value`` with every 0-dim tensor in it a float, through dicts and lists: a captured step's learning
    rates are device tensors (the schedule fills them in place), and a launch without the graph that
    loaded one would keep a Tensor for its lr, on which Adam quietly leaves its fast path."""
    if isinstance(value, Tensor) and value.dim() == 0:
        return float(value)
    if isinstance(value, dict):
        return {key: plain_lr(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_lr(item) for item in value]
    return value


def resolve_precision(precision: Precision, device: torch.device) -> torch.dtype:
    if precision == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


MEASURED_PEAKS = "peak_flops.json"  # {GPU name: {precision: FLOP/s}}, under MLSTM_HOME


def datasheet_flops(device: torch.device) -> float | None:
    """The GPU's datasheet dense bf16 peak, for the GPUs GPU_PEAK_FLOPS names."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_FLOPS.items() if key in name), None)


# The precisions' short names: the job's --precision values, and the keys of MEASURED_PEAKS.
PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def measured_flops(device: torch.device, dtype: torch.dtype, home: Path | None) -> float | None:
    """MLSTM_PEAK_FLOPS, else the matmul peak benchmarks/pretrain.py measured on this GPU in this dtype."""
    if os.environ.get("MLSTM_PEAK_FLOPS"):
        return float(os.environ["MLSTM_PEAK_FLOPS"])
    if device.type != "cuda" or home is None:
        return None
    return peak_in_file(home / MEASURED_PEAKS, torch.cuda.get_device_name(device), dtype)


def peak_in_file(path: Path, gpu: str, dtype: torch.dtype) -> float | None:
    """The peak a file of MEASURED_PEAKS holds for this GPU (by name) and precision, if any."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get(gpu, {}).get(PRECISION_NAMES.get(dtype))
    except (ValueError, AttributeError):
        return None  # a damaged file costs the metric, never the run
    return float(value) if value else None


def peak_flops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, home: Path | None = None
) -> float | None:
    """The peak ``mfu`` is against: measured where known, else the datasheet's."""
    return measured_flops(device, dtype, home) or datasheet_flops(device)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


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
    with autocast(inputs.device, dtype):
        logits, (h_BH, c_BH), _ = module(inputs, state)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(parameters, clip)
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    scaler.step(optimizer)
    scaler.update()
    # An overflow makes the scaler skip the update and lower the scale.
    skipped = scaler.is_enabled() and scaler.get_scale() < scale
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), (h_BH.detach().float(), c_BH.detach().float()), skipped


@dataclass
class World:
    """This process's place in the job, from torchrun's environment (a world of one without it)."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, *, group: bool = False) -> World:
        """``group``: a process group even for a world of one (``--sharding full`` shards over it)."""
        rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if size > 1 or group:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(rank, local_rank, size, device)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks; a world of one returns them as they are (no device round trip)."""
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set: an all-reduce (a host sync) on several ranks, none on one."""
        return flag if self.size == 1 else self.sum([float(flag)])[0] > 0

    def gather_rows(self, tensor: Tensor) -> Tensor:
        """This rank's rows of a [B/W, …] tensor joined with every other rank's, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def close(self) -> None:
        if dist.is_initialized():
            # The trainer is in a reference cycle (its schedule's lambda holds it), so without a
            # collection here its DDP reducer, ZeRO optimizer or FSDP state, each holding the process
            # group, would be freed only at interpreter exit, after destroy_process_group: the gloo
            # group's destructor then runs during finalisation, its peers already gone, and a rank
            # aborts after its work is done ("terminate called without an active exception").
            gc.collect()
            dist.destroy_process_group()


class Preempted:
    """Set by SIGTERM (Slurm preemption, pod eviction, torchrun shutting down, a cancelled flow run)."""

    def __init__(self) -> None:
        self.signalled = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signalled = True


# Steps between the ranks' agreement on a SIGTERM: each is an all-reduce the host waits for. One rank
# reads its own flag every step, at no cost.
SIGNAL_EVERY = 10


def log(world: World, message: str) -> None:
    if world.is_main:
        print(message, flush=True)


def open_stream(world: World, corpus: str, split: str, settings: Settings) -> ByteStream:
    """Open a split on every rank; the first rank of each node downloads, the others then read its cache."""
    options = {"endpoint_url": settings.s3_endpoint_url, "max_attempts": settings.s3_max_attempts}
    cache = settings.home.resolve() / "cache" / "shards"
    if world.local_rank != 0:
        world.barrier()
    stream = open_split(corpus, split, cache, **options)
    if world.local_rank == 0:
        world.barrier()
    return stream


class Trainer:
    """One run: the model, its optimizer and schedule, the carried state, and where the stream is."""

    def __init__(self, config: TrainConfig, world: World, settings: Settings) -> None:
        self.config, self.world, self.settings = config, world, settings
        self.store: Store = open_store(
            config.store or settings.resolved_store_uri,
            endpoint_url=settings.s3_endpoint_url,
            max_attempts=settings.s3_max_attempts,
        )
        corpus_store, manifest_key = split_object_uri(config.corpus, endpoint_url=settings.s3_endpoint_url)
        self.manifest: dict[str, Any] = json.loads(corpus_store.read_bytes(manifest_key))  # read once
        self.train = open_stream(world, config.corpus, "train", settings)
        self.val = open_stream(world, config.corpus, "val", settings)
        self.plan = BatchPlan(len(self.train), config.batch_size, config.seq_len, world.size, world.rank)
        self.total_steps = config.total_steps or self.plan.steps_per_epoch
        self.dtype = resolve_precision(config.precision, world.device)

        torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP checks them too)
        self.model = MLSTM(
            preset(config.preset), recurrence=config.recurrence, compile_gates=config.compile == "auto"
        ).to(world.device)
        # A captured step (one rank on a GPU) reads lr from a device tensor the schedule fills (a float
        # would be baked in), and fused Adam skips an fp16 overflow step on the device, without asking
        # the host. Otherwise the sharding says who holds what.
        # --sharding full is honoured on one rank too (FSDP2 over a world of one: the many-rank code and
        # its DCP checkpoints), which a graph does not capture.
        self.graphed = (
            config.cuda_graph == "auto"
            and config.sharding != "full"
            and graph_supported(world.device, world.size)
        )
        self.ddp: nn.Module
        self.optimizer: torch.optim.Optimizer
        if self.graphed:
            self.ddp = self.model
            self.optimizer = torch.optim.Adam(
                self.model.parameters(),
                lr=torch.tensor(config.effective_lr(), device=world.device),
                fused=True,
                capturable=True,  # or Adam refuses to be captured
            )
        else:
            self.ddp, self.optimizer = shard.wrap(
                self.model,
                config.sharding,
                world_size=world.size,
                device=world.device,
                dtype=self.dtype,
                lr=config.effective_lr(),
            )
        self.graph_step: GraphedStep | None = None  # captured at the first step, after any resume
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, warmup_steps=config.warmup_steps, total_steps=self.total_steps),
        )
        # The schedule computes in floats and fills the captured Adam's lr tensor in place; its own state
        # (and so every checkpoint) then holds numbers, whichever way the step runs.
        self.schedule.base_lrs = [float(lr) for lr in self.schedule.base_lrs]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = float(group["initial_lr"])
        self.scaler = torch.amp.GradScaler(world.device.type, enabled=self.dtype == torch.float16)
        self.state: State = self.model.zero_state(len(self.plan.rows))
        self.step = 0  # steps done; the next step to take
        self.skipped_steps = 0
        self.last_loss = math.nan
        self.last_val_bpc: float | None = None
        self.mlflow_run_id = config.mlflow_run_id

    # -- checkpoints ---------------------------------------------------------------------------------

    def resume(self) -> bool:
        # A sharded checkpoint's DCP files, where a store is not a folder they can be read in place.
        # One folder a rank: a node's ranks do not wait on each other to download.
        scratch = (
            self.settings.home.resolve()
            / "cache"
            / "checkpoints"
            / f"{self.config.run_name}-rank{self.world.rank}"
        )
        started = time.perf_counter()
        found = checkpoint.load_intact(self.store, self.config.run_name, shards_to=scratch)
        if found is None:
            return False
        saved, damaged = found
        if damaged:
            log(self.world, f"warning: {'; '.join(damaged)}; resuming from step {saved.step} ({saved.uri})")
        mismatched = {
            name: (saved.meta["config"].get(name), value)
            for name, value in self.config.model_dump(include=set(RUN_FIELDS)).items()
            if saved.meta["config"].get(name) != value
        }
        if mismatched:
            changes = ", ".join(
                f"--{k.replace('_', '-')} was {old!r}, now {new!r}" for k, (old, new) in mismatched.items()
            )
            raise ValueError(
                f"run {self.config.run_name!r} was started with other settings ({changes}): "
                "relaunch with the same settings, or choose a new --run"
            )
        if saved.meta["total_steps"] != self.total_steps:
            raise ValueError(
                f"run {self.config.run_name!r} has a schedule of {saved.meta['total_steps']} steps, this launch "
                f"{self.total_steps}: relaunch with --total-steps {saved.meta['total_steps']}"
            )
        state = saved.state
        # Learning rates as numbers: a checkpoint written before they were saved so held device tensors.
        state["schedule"] = plain_lr(state["schedule"])
        if "param_groups" in state:  # a sharded checkpoint's run state
            state["param_groups"] = plain_lr(state["param_groups"])
        if "optimizer" in state:
            state["optimizer"] = {
                **state["optimizer"],
                "param_groups": plain_lr(state["optimizer"]["param_groups"]),
            }
        # A checkpoint's optimizer settings say how it ran (fused, lr as a number), not how this launch runs.
        keys = ("lr", "fused", "capturable", "foreach")
        own = [{k: g[k] for k in keys} for g in self.optimizer.param_groups] if self.graphed else []
        if saved.sharded is not None:  # DCP files: each rank reads its share, resharded to this launch
            shard.load_sharded(self.model, self.optimizer, saved.sharded)
            shutil.rmtree(scratch, ignore_errors=True)  # a download's copy (a folder store's files stay)
            for group, hyper in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
                group["lr"] = hyper["lr"]  # this launch's param groups, at the saved step's lr
        else:
            if own:
                # Loaded with this launch's flags, so Adam puts each parameter's step count on the device,
                # where fused, capturable Adam reads it (the file's flags would leave it on the CPU).
                state["optimizer"] = {
                    **state["optimizer"],
                    "param_groups": [
                        {**group, **{k: mine[k] for k in keys[1:]}}
                        for group, mine in zip(state["optimizer"]["param_groups"], own, strict=True)
                    ],
                }
            shard.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        for group, mine in zip(self.optimizer.param_groups, own, strict=False):
            if isinstance(mine["lr"], Tensor):
                group["lr"] = mine["lr"].fill_(float(group["lr"]))
            group.update({k: mine[k] for k in keys[1:]})
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        rows = self.plan.rows
        self.state = (
            state["h"][rows.start : rows.stop].to(self.world.device),
            state["c"][rows.start : rows.stop].to(self.world.device),
        )
        torch.set_rng_state(state["rng"])
        self.step, self.skipped_steps = saved.step, int(saved.meta["skipped_steps"])
        self.last_loss, self.last_val_bpc = saved.meta["loss"], saved.meta["val_bpc"]
        self.mlflow_run_id = self.mlflow_run_id or saved.meta.get("mlflow_run_id")
        seconds = time.perf_counter() - started
        log(
            self.world,
            f"resumed run {self.config.run_name} from step {self.step} ({saved.uri}) in {seconds:.2f} s",
        )
        return True

    def save(self) -> str | None:
        """Every rank gathers the carried state; rank 0 writes (each rank its share of a sharded
        state, through DCP). Returns the URI on rank 0."""
        started = time.perf_counter()
        h, c = (self.world.gather_rows(t.detach()) for t in self.state)
        if shard.is_sharded(self.model, self.optimizer):
            return self.save_sharded(h, c, started)
        weights, optimizer_state = shard.full_state(self.model, self.optimizer)
        if not self.world.is_main:
            return None
        # The same file whether the step was captured or not: lr a number, Adam's defaults.
        optimizer_state["param_groups"] = plain_lr(optimizer_state["param_groups"])
        if self.graphed:
            optimizer_state["param_groups"] = [
                {**g, "fused": None, "capturable": False} for g in optimizer_state["param_groups"]
            ]
        state = {
            "model": weights,
            "optimizer": optimizer_state,
            "schedule": plain_lr(self.schedule.state_dict()),
            "scaler": self.scaler.state_dict(),
            "h": h.cpu(),
            "c": c.cpu(),
            "rng": torch.get_rng_state(),
        }
        uri = checkpoint.save_checkpoint(self.store, self.config.run_name, self.step, state, self.meta())
        log(self.world, f"checkpoint step={self.step} uri={uri} in {time.perf_counter() - started:.2f} s")
        return uri

    def save_sharded(self, h: Tensor, c: Tensor, started: float) -> str | None:
        """Each rank writes its share of the weights and Adam's state (DCP) into its own scratch
        folder and copies it into the store; once all have, rank 0 writes the rest, ``meta.json``
        with every file's sha256, then ``latest.json``."""
        run, step = self.config.run_name, self.step
        scratch = self.settings.home.resolve() / "cache" / "checkpoints"
        scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            prefix=f"{run}-{step}-rank{self.world.rank}-", dir=scratch
        ) as folder:
            shard.save_sharded(self.model, self.optimizer, Path(folder))
            mine = checkpoint.save_shards(self.store, run, step, Path(folder))
        shards: list[dict[str, str] | None] = [None] * self.world.size
        dist.all_gather_object(shards, mine)  # also: every rank's files are in the store
        if not self.world.is_main:
            return None
        run_state = {
            **shard.optimizer_layout(self.model, self.optimizer),
            "schedule": plain_lr(self.schedule.state_dict()),
            "scaler": self.scaler.state_dict(),
            "h": h.cpu(),
            "c": c.cpu(),
            "rng": torch.get_rng_state(),
        }
        files = {name: digest for part in shards for name, digest in (part or {}).items()}
        uri = checkpoint.save_sharded_checkpoint(self.store, run, step, run_state, files, self.meta())
        seconds = time.perf_counter() - started
        log(
            self.world,
            f"checkpoint step={step} uri={uri} in {seconds:.2f} s (sharded: {len(files)} DCP files)",
        )
        return uri

    def meta(self) -> dict[str, Any]:
        """What a checkpoint's ``meta.json`` says about the run besides its files."""
        return {
            "model": {
                "hidden_size": self.model.config.hidden_size,
                "embed_size": self.model.config.embed_size,
                "vocab_size": self.model.config.vocab_size,
            },
            "preset": self.config.preset,
            "config": self.config.model_dump(),
            "corpus": self.config.corpus,
            "cleaning": self.manifest["cleaning"]["name"],
            "total_steps": self.total_steps,
            "skipped_steps": self.total_skipped_steps(),
            "loss": self.last_loss,
            "val_bpc": self.last_val_bpc,
            "world_size": self.world.size,
            "mlflow_run_id": self.mlflow_run_id,
        }

    # -- steps ---------------------------------------------------------------------------------------

    def batch(self, plan: BatchPlan, stream: ByteStream, step: int) -> tuple[Tensor, Tensor]:
        rows = torch.from_numpy(plan.batch(stream, step).astype(np.int64))
        if self.world.device.type == "cuda":
            # From page-locked memory the copy is asynchronous: the host goes on to the next step's launch.
            rows = rows.pin_memory().to(self.world.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def total_skipped_steps(self) -> int:
        """fp16 overflow steps: counted on the host, and on the device by a captured step."""
        on_device = int(self.graph_step.skipped.item()) if self.graph_step is not None else 0
        return self.skipped_steps + on_device

    def train_step(self) -> Tensor:
        step = self.step
        if step and self.plan.epoch_of(step) != self.plan.epoch_of(step - 1):
            self.state = self.model.zero_state(len(self.plan.rows))  # a new epoch starts each row over
            if self.graph_step is not None:
                self.graph_step.set_state(self.state)
                self.state = self.graph_step.state
        inputs, targets = self.batch(self.plan, self.train, step)
        if self.graphed:
            if self.graph_step is None:
                self.graph_step = GraphedStep(
                    self.ddp,
                    self.optimizer,
                    self.scaler,
                    self.state,
                    inputs,
                    targets,
                    dtype=self.dtype,
                    clip=self.config.clip,
                )
            loss = self.graph_step(inputs, targets)
            self.state = self.graph_step.state  # the graph's own tensors: they carry to the next replay
            self.schedule.step()
            self.step += 1
            return loss
        loss, self.state, skipped = optimizer_step(
            self.ddp,
            self.optimizer,
            self.scaler,
            inputs,
            targets,
            self.state,
            dtype=self.dtype,
            clip=self.config.clip,
        )
        self.skipped_steps += skipped
        self.schedule.step()
        self.step += 1
        return loss.detach()

    @torch.no_grad()
    def validate(self) -> float | None:
        """Bits per character on the first ``val_steps`` steps of the val split, from a zero state."""
        width = self.config.seq_len + 1
        rows = min(self.config.batch_size, len(self.val) // width // self.world.size * self.world.size)
        if rows == 0:
            log(
                self.world,
                f"validation skipped: the val split ({len(self.val):,} bytes) is shorter than {self.world.size} rows of {width}",
            )
            return None
        plan = BatchPlan(len(self.val), rows, self.config.seq_len, self.world.size, self.world.rank)
        state = self.model.zero_state(len(plan.rows))
        nats, count = 0.0, 0.0
        for step in range(min(self.config.val_steps, plan.steps_per_epoch)):
            inputs, targets = self.batch(plan, self.val, step)
            with autocast(self.world.device, self.dtype):
                logits, state, _ = self.model(inputs, state)
            state = (state[0].float(), state[1].float())
            nats += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += float(targets.numel())
        nats, count = self.world.sum([nats, count])
        return nats / count / math.log(2)


class Tracker:
    """Rank 0's MLflow run: params once, metrics asynchronously so logging never stalls a step."""

    def __init__(self, trainer: Trainer) -> None:
        try:
            import mlflow
        except ImportError as error:
            raise ValueError(
                "MLflow is not installed where rank 0 runs: install it, or pass --tracking off to keep "
                "the run's metrics in its log only"
            ) from error

        from tasks.tracking import start_tracking

        self.mlflow = mlflow
        self.trainer = trainer
        config = trainer.config
        corpus_id = trainer.manifest["corpus_id"]
        self.run = start_tracking(
            trainer.settings,
            run_id=trainer.mlflow_run_id,
            run_name=f"pretrain-{config.run_name}",
            tags={
                "stage": "pretrain",
                "run": config.run_name,
                "corpus_id": corpus_id,
                "manifest_uri": config.corpus,
            },
        )
        trainer.mlflow_run_id = self.run.info.run_id
        model_config = trainer.model.config
        params = {
            **config.model_dump(include=set(RUN_FIELDS)),
            "total_steps": trainer.total_steps,
            "effective_lr": config.effective_lr(),
            "hidden_size": model_config.hidden_size,
            "num_params": model_config.num_params,
            "corpus_id": corpus_id,
        }
        with contextlib.suppress(self.mlflow.exceptions.MlflowException):  # same values on a resume
            self.mlflow.log_params(params, run_id=self.run.info.run_id)
        self.mlflow.set_tags(
            {
                "world_size": trainer.world.size,
                "precision": str(trainer.dtype).removeprefix("torch."),
                "device": torch.cuda.get_device_name() if trainer.world.device.type == "cuda" else "cpu",
            },
        )

    def metrics(self, values: dict[str, float], step: int) -> None:
        finite = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        self.mlflow.log_metrics(finite, step=step, run_id=self.run.info.run_id, synchronous=False)

    def checkpoint(self, uri: str) -> None:
        self.mlflow.set_tags({"checkpoint_uri": uri, f"checkpoint_step_{self.trainer.step}": uri})

    def close(self, *, preempted: bool) -> None:
        from mlflow.tracking import MlflowClient

        self.mlflow.flush_async_logging()
        with contextlib.suppress(Exception):  # a plot is a convenience: never fail the run over it
            history = MlflowClient().get_metric_history(self.run.info.run_id, "loss")
            self._plot(sorted((m.step, m.value) for m in history))
        self.mlflow.end_run("KILLED" if preempted else "FINISHED")

    def _plot(self, points: list[tuple[int, float]]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4))
        axes.plot([s for s, _ in points], [v / math.log(2) for _, v in points])
        axes.set(xlabel="step", ylabel="train bits per character", title=self.trainer.config.run_name)
        axes.grid(alpha=0.3)
        self.mlflow.log_figure(figure, "loss_curve.png")
        plt.close(figure)


def fit(config: TrainConfig, world: World, settings: Settings) -> dict[str, Any]:
    trainer = Trainer(config, world, settings)
    resumed = trainer.resume()
    stop = min(trainer.total_steps, config.max_steps or trainer.total_steps)
    tracker = Tracker(trainer) if world.is_main and config.tracking == "mlflow" else None
    preempted = Preempted()
    tokens_per_step = config.batch_size * config.seq_len
    peak = peak_flops(world.device, trainer.dtype, settings.home)
    datasheet = datasheet_flops(world.device)
    log(
        world,
        f"run {config.run_name}: {config.preset} ({trainer.model.config.num_params:,} parameters), "
        f"{world.size} rank(s) on {world.device.type}, {str(trainer.dtype).removeprefix('torch.')}, "
        f"batch {config.batch_size}×{config.seq_len}, steps {trainer.step}→{stop} of {trainer.total_steps}"
        + (" (resumed)" if resumed else ""),
    )
    checkpoint_uri = None
    window_start, window_steps = time.perf_counter(), 0
    while trainer.step < stop:
        loss = trainer.train_step()
        window_steps += 1
        step = trainer.step
        # One rank reads its flag; several agree every SIGNAL_EVERY steps (the same steps on every rank).
        stopping = (world.size == 1 or step % SIGNAL_EVERY == 0 or step == stop) and world.any(
            preempted.signalled
        )
        if step % config.log_every == 0 or step == stop or stopping:
            trainer.last_loss = world.sum([loss.item()])[0] / world.size
            seconds = time.perf_counter() - window_start
            chars_per_s = window_steps * tokens_per_step / seconds
            metrics: dict[str, float] = {
                "loss": trainer.last_loss,
                "bpc": trainer.last_loss / math.log(2),
                "lr": float(trainer.schedule.get_last_lr()[0]),
                "chars_per_s": chars_per_s,
                "loss_scale": trainer.scaler.get_scale() if trainer.scaler.is_enabled() else 1.0,
                "skipped_steps": float(trainer.total_skipped_steps()),
                # rank 0's share: what --sharding saves
                "optimizer_bytes": float(shard.optimizer_state_bytes(trainer.optimizer)),
            }
            flops = 6 * trainer.model.config.num_params * chars_per_s
            if peak:
                metrics["mfu"] = flops / (peak * world.size)
            if datasheet:
                metrics["mfu_datasheet"] = flops / (datasheet * world.size)
            log(world, joblog.progress_line({"step": step, "of": trainer.total_steps, **metrics}))
            if tracker:
                tracker.metrics(metrics, step)
            window_start, window_steps = time.perf_counter(), 0
        if step % config.val_every == 0 or step == stop:
            trainer.last_val_bpc = trainer.validate()
            log(world, f"validation step={step} val_bpc={trainer.last_val_bpc}")
            if tracker and trainer.last_val_bpc is not None:
                tracker.metrics({"val_bpc": trainer.last_val_bpc}, step)
        if step % config.checkpoint_every == 0 or step == stop or stopping:
            checkpoint_uri = trainer.save()
            if tracker and checkpoint_uri:
                tracker.checkpoint(checkpoint_uri)
        if stopping:
            log(world, f"SIGTERM: checkpointed at step {step}; launch again with the same run name to resume")
            break
    if checkpoint_uri is None and world.is_main:  # nothing to do: already at the budget or the end
        latest = checkpoint.read_latest(trainer.store, config.run_name)
        checkpoint_uri = latest["checkpoint_uri"] if latest else None
    if tracker:
        tracker.close(preempted=trainer.step < stop)
    result = {
        "run": config.run_name,
        "run_id": trainer.mlflow_run_id,
        "checkpoint_uri": checkpoint_uri,
        "steps": trainer.step,
        "total_steps": trainer.total_steps,
        "final_loss": trainer.last_loss,
        "val_bpc": trainer.last_val_bpc,
        "skipped_steps": trainer.total_skipped_steps(),
        "preempted": bool(trainer.step < stop),
    }
    log(world, "result " + json.dumps(result))
    # Every rank waits for rank 0's checkpoint and MLflow: a rank that tears its process group down
    # while another still talks to it can abort the job (gloo: "terminate called without an active
    # exception").
    world.barrier()
    return result


def main(argv: list[str] | None = None) -> int:
    config = TrainConfig.from_args(sys.argv[1:] if argv is None else argv)
    world = World.from_env(group=config.sharding == "full")
    try:
        result = fit(config, world, get_settings())
    except (StreamError, ValueError) as error:
        log(world, f"{joblog.ERROR_PREFIX}{error}")  # the launcher's watcher fails the job with it, unretried
        return 2
    finally:
        world.close()
    # A preempted launch exits non-zero, so launchers and the flow see an unfinished job.
    return 143 if result["preempted"] else 0


if __name__ == "__main__":
    die_with_parent()  # a rank stops (and checkpoints) when its torchrun is killed
    raise SystemExit(main())
