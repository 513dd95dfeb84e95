"""The pretraining job: ``torchrun --nproc-per-node N -m tasks.pretrain.train --corpus URI --preset NAME --run-name NAME``.

The same code on one CPU, one GPU, 8 GPUs or 16 nodes × 8: rank and world size come from torchrun's
environment, DDP averages gradients, autocast gives mixed precision (bf16 where the GPU has it, fp16
with a dynamic loss scale where it does not, fp32 on CPU or on request). Data follows DESIGN.md: the
train split is one byte stream, the global batch has B contiguous rows, the hidden state carries from
step to step (truncated BPTT), and where a step reads is a function of the step alone, so a relaunch
with the same ``--run-name`` resumes from ``latest.json`` exactly, with any number of ranks. Beside it:
``world`` (ranks), ``step`` (the step; ``graphed`` captures it), ``checkpointer``, ``metrics``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from models.mlstm import MLSTM, State, preset
from models.precision import autocast, resolve_precision
from tasks.corpus.manifest import Manifest, read_manifest
from tasks.jobs import checkpoint, joblog
from tasks.jobs import sharding as shard
from tasks.jobs.checkpointer import Checkpointer
from tasks.jobs.config import neutral_values
from tasks.jobs.optim import build_optimizer
from tasks.jobs.torchrun import die_with_parent
from tasks.jobs.world import Preempted, World, log
from tasks.pretrain.config import TrainConfig
from tasks.pretrain.graphed import GraphedStep, graph_supported
from tasks.pretrain.metrics import Report, Throughput, Tracker
from tasks.pretrain.mix import RowPlan, replay_rows, train_sources
from tasks.pretrain.parent import Parent, read_parent
from tasks.pretrain.result import FitResult
from tasks.pretrain.step import optimizer_step
from tasks.pretrain.stream import BatchPlan, ByteStream, StreamError, open_split
from tasks.settings import Settings, get_settings
from tasks.store import Store, open_store, split_object_uri


def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The papers' schedule: linear warm-up, then linear decay to zero at the end of the run."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    return warmup * max(0.0, 1.0 - step / total_steps)


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
        self.manifest: Manifest = read_manifest(corpus_store, manifest_key)  # read once
        options: dict[str, Any] = {
            "endpoint_url": settings.s3_endpoint_url,
            "max_attempts": settings.s3_max_attempts,
        }
        cache = settings.home.resolve() / "cache" / "shards"
        # A continued run: its parent (meta.json only; the weights load in resume) and what it reads.
        self.parent = read_parent(config.init_from, **options) if config.init_from else None
        self.sources = train_sources(config, self.manifest, self.parent, **options)
        with world.local_rank_first():  # it downloads a split; the node's other ranks read its cache
            self.train = open_split(config.corpus, "train", cache, keep=self.sources.fresh, **options)
        self.replay: ByteStream | None = None
        if self.sources.replay_bytes:
            assert self.parent is not None
            with world.local_rank_first():
                self.replay = open_split(self.parent.corpus, "train", cache, **options)
        with world.local_rank_first():
            self.val = open_split(config.corpus, "val", cache, **options)
        self.plan = RowPlan(
            len(self.train),
            len(self.replay) if self.replay is not None else 0,
            config.batch_size,
            config.seq_len,
            replay_rows(config.batch_size, config.replay, config.seed),
            world.size,
            world.rank,
        )
        self.total_steps = config.total_steps or self.plan.steps_per_epoch
        self.dtype = resolve_precision(config.precision, world.device)

        world.take_threads(preset(config.preset).hidden_size)
        torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP checks them too)
        self.model = MLSTM(
            preset(config.preset), recurrence=config.recurrence, compile_gates=config.compile == "auto"
        ).to(world.device)
        # A captured step (one rank on a GPU) needs an Adam it can capture; otherwise the sharding says
        # who holds what. --sharding full is honoured on one rank too (FSDP2 over a world of one: the
        # many-rank code and its DCP checkpoints), which a graph does not capture.
        self.graphed = (
            config.cuda_graph == "auto"
            and config.sharding != "full"
            and graph_supported(world.device, world.size)
        )
        self.ddp, self.optimizer = (
            (
                self.model,
                build_optimizer(self.model.parameters(), config, lr=config.effective_lr(), path="captured"),
            )
            if self.graphed
            else shard.wrap(
                self.model,
                config.sharding,
                world_size=world.size,
                device=world.device,
                dtype=self.dtype,
                optimizer=config,
                lr=config.effective_lr(),
            )
        )
        self.graph_step: GraphedStep | None = None  # captured at the first step, after any resume
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(
                step, warmup_steps=config.warmup(self.total_steps), total_steps=self.total_steps
            ),
        )
        # The schedule computes in floats and fills the captured Adam's lr tensor in place; its own state
        # (and so every checkpoint) then holds numbers, whichever way the step runs.
        self.schedule.base_lrs = [float(lr) for lr in self.schedule.base_lrs]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = float(group["initial_lr"])
        self.scaler = torch.amp.GradScaler(world.device.type, enabled=self.dtype == torch.float16)
        self.checkpoints = Checkpointer(
            self.store,
            config.run_name,
            world,
            settings.home.resolve() / "cache" / "checkpoints",
            self.model,
            self.optimizer,
            self.schedule,
            self.scaler,
            graphed=self.graphed,
        )
        self.state: State = self.model.zero_state(len(self.plan.rows))
        self.step = 0  # steps done; the next step to take
        self.skipped_steps = 0
        self.last_loss = math.nan
        self.last_val_bpc: float | None = None
        self.mlflow_run_id = config.mlflow_run_id

    def resume(self) -> bool:
        """Continue the run from its newest intact checkpoint, if it has one (see ``Checkpointer``)."""
        saved = self.checkpoints.resume(
            self.config.run_settings(), self.total_steps, neutral=neutral_values(type(self.config))
        )
        if saved is None:
            if self.parent is not None:
                self.start_from_parent(self.parent)
            return False
        rows = self.plan.rows
        h, c = (saved.state[name][rows.start : rows.stop].to(self.world.device) for name in ("h", "c"))
        self.state = (h, c)
        self.step, self.skipped_steps = saved.step, int(saved.meta["skipped_steps"])
        self.last_loss, self.last_val_bpc = saved.meta["loss"], saved.meta["val_bpc"]
        self.mlflow_run_id = self.mlflow_run_id or saved.meta.get("mlflow_run_id")
        return True

    def start_from_parent(self, parent: Parent) -> None:
        """A new continued run: the parent's weights (and with --init-optimizer its Adam state), checked
        to be the checkpoint the run is known by and of this run's model."""
        saved = checkpoint.load_checkpoint(
            parent.checkpoint_uri,
            endpoint_url=self.settings.s3_endpoint_url,
            max_attempts=self.settings.s3_max_attempts,
        )
        if checkpoint.checkpoint_digest(saved.meta) != parent.digest:
            raise ValueError(
                f"--init-from {parent.checkpoint_uri} changed while the run started: launch again"
            )
        if saved.model_config != self.model.config:
            raise ValueError(
                f"--init-from {parent.checkpoint_uri} is a {parent.preset} checkpoint; this run's --preset "
                f"{self.config.preset} is another model: continue with --preset {parent.preset}"
            )
        self.checkpoints.start_from(saved, optimizer=self.config.init_optimizer)
        log(
            self.world,
            f"run {self.config.run_name}: starts from {parent.checkpoint_uri} (step {parent.step})",
        )

    def save(self) -> str | None:
        """A checkpoint of this step, written by rank 0 (each rank its share of a sharded state); its
        URI on rank 0."""
        return self.checkpoints.save(self.step, self.state, self.meta())

    def meta(self) -> dict[str, Any]:
        """What a checkpoint's ``meta.json`` says about the run besides its files."""
        return {
            "model": {k: getattr(self.model.config, k) for k in ("hidden_size", "embed_size", "vocab_size")},
            "preset": self.config.preset,
            "config": self.config.model_dump(),
            "corpus": self.config.corpus,
            "cleaning": self.manifest.cleaning.name,
            "total_steps": self.total_steps,
            "skipped_steps": self.total_skipped_steps(),
            "loss": self.last_loss,
            "val_bpc": self.last_val_bpc,
            "world_size": self.world.size,
            "mlflow_run_id": self.mlflow_run_id,
            "parent": self.parent.model_dump() if self.parent else None,
            "replay_rows": len(self.plan.replay),
        }

    def batch(self, plan: BatchPlan, stream: ByteStream, step: int) -> tuple[Tensor, Tensor]:
        return self.on_device(plan.batch(stream, step))

    def on_device(self, batch: np.ndarray) -> tuple[Tensor, Tensor]:
        rows = torch.from_numpy(batch.astype(np.int64))
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
        restarts = self.plan.restarts(step)
        if restarts.any():  # a row whose stream starts a new epoch starts over
            if restarts.all():
                self.state = self.model.zero_state(len(self.plan.rows))
            else:
                keep = torch.from_numpy(~restarts).to(self.world.device)[:, None]
                self.state = (self.state[0] * keep, self.state[1] * keep)
            if self.graph_step is not None:
                self.graph_step.set_state(self.state)
                self.state = self.graph_step.state
        inputs, targets = self.on_device(self.plan.batch(self.train, self.replay, step))
        on = (self.ddp, self.optimizer, self.scaler)
        if self.graphed:
            if self.graph_step is None:
                self.graph_step = GraphedStep(
                    *on, self.state, inputs, targets, dtype=self.dtype, clip=self.config.clip
                )
            loss = self.graph_step(inputs, targets)
            self.state = self.graph_step.state  # the graph's own tensors: they carry to the next replay
        else:
            loss, self.state, skipped = optimizer_step(
                *on, inputs, targets, self.state, dtype=self.dtype, clip=self.config.clip
            )
            self.skipped_steps += skipped
        self.schedule.step()
        self.step += 1
        return loss

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


def start_tracker(trainer: Trainer) -> Tracker:
    """Rank 0's MLflow run for this run, its params the settings the numbers depend on."""
    config, model_config = trainer.config, trainer.model.config
    params = {
        **config.run_settings(),
        "total_steps": trainer.total_steps,
        "effective_lr": config.effective_lr(),
        "hidden_size": model_config.hidden_size,
        "num_params": model_config.num_params,
    }
    if trainer.parent is not None:
        params["replay_rows"] = len(trainer.plan.replay)
    tracker = Tracker(
        trainer.settings,
        run_name=config.run_name,
        run_id=trainer.mlflow_run_id,
        corpus=config.corpus,
        corpus_id=trainer.manifest.corpus_id,
        params=params,
        tags=trainer.parent.tags() if trainer.parent else {},
        world=trainer.world,
        dtype=trainer.dtype,
    )
    trainer.mlflow_run_id = tracker.run_id
    return tracker


# A model that guesses uniformly over the 256 bytes scores ln 256 ≈ 5.5 nats; a hundred times that is no
# longer learning, whatever the data.
DIVERGED_NATS = 100 * math.log(256)


def diverged(loss: float) -> bool:
    return not math.isfinite(loss) or loss > DIVERGED_NATS


@torch.no_grad()
def bits_per_byte(model: MLSTM, stream: ByteStream, rows: int, seq_len: int) -> float:
    """Next-byte cross-entropy in bits over the whole stream, ``rows`` rows carried from a zero state, on
    one process: how a benchmark scores a model on a held-out text (the job's own validation, over its
    ranks and to ``val_steps``, is ``Trainer.validate``)."""
    plan = BatchPlan(len(stream), min(rows, len(stream) // (seq_len + 1)), seq_len)
    state = model.zero_state(len(plan.rows))
    nats, count = 0.0, 0
    for step in range(plan.steps_per_epoch):
        batch = torch.from_numpy(plan.batch(stream, step).astype(np.int64))
        logits, state, _ = model(batch[:, :-1], state)
        nats += F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    return nats / count / math.log(2)


def fit(config: TrainConfig, world: World, settings: Settings) -> FitResult:
    trainer = Trainer(config, world, settings)
    resumed = trainer.resume()
    stop = min(trainer.total_steps, config.max_steps or trainer.total_steps)
    report = Report(world, start_tracker(trainer) if world.is_main and config.tracking == "mlflow" else None)
    preempted = Preempted(world)
    log(
        world,
        f"run {config.run_name}: {config.preset} ({trainer.model.config.num_params:,} parameters), "
        f"{world.size} rank(s) on {world.device.type}, {str(trainer.dtype).removeprefix('torch.')}, "
        f"batch {config.batch_size}×{config.seq_len}, steps {trainer.step}→{stop} of {trainer.total_steps}"
        + (" (resumed)" if resumed else ""),
    )
    checkpoint_uri = None
    speed = Throughput(
        world,
        trainer.dtype,
        settings.home,
        chars_per_step=config.batch_size * config.seq_len,
        num_params=trainer.model.config.num_params,
    )
    while trainer.step < stop:
        loss = trainer.train_step()
        speed.steps += 1
        step = trainer.step
        stopping = preempted.stops_after(step, stop)
        if step % config.log_every == 0 or step == stop or stopping:
            trainer.last_loss = world.sum([loss.item()])[0] / world.size
            if diverged(trainer.last_loss) and not trainer.scaler.is_enabled():
                # Every later step, checkpoint and metric would be as bad (fp16's scaler skips an
                # overflowing step instead, and says so).
                raise ValueError(
                    f"the loss is {trainer.last_loss:.4g} nats at step {step}: training diverged; lower --lr "
                    f"(now {config.lr:g}) or raise --warmup-steps, and start again from an earlier checkpoint"
                )
            chars_per_s = speed.chars_per_s()
            metrics: dict[str, float] = {
                "loss": trainer.last_loss,
                "bpc": trainer.last_loss / math.log(2),
                "lr": float(trainer.schedule.get_last_lr()[0]),
                "chars_per_s": chars_per_s,
                "loss_scale": trainer.scaler.get_scale() if trainer.scaler.is_enabled() else 1.0,
                "skipped_steps": float(trainer.total_skipped_steps()),
                # rank 0's share: what --sharding saves
                "optimizer_bytes": float(shard.optimizer_state_bytes(trainer.optimizer)),
                **speed.utilisation(chars_per_s),
            }
            report.progress(step, trainer.total_steps, metrics)
            speed.restart()
        if step % config.val_every == 0 or step == stop:
            trainer.last_val_bpc = trainer.validate()
            report.validation(step, trainer.last_val_bpc)
        if step % config.checkpoint_every == 0 or step == stop or stopping:
            checkpoint_uri = trainer.save()
            report.checkpoint(step, checkpoint_uri)
        if stopping:
            log(world, joblog.stopped_line(step))
            break
    if checkpoint_uri is None and world.is_main:  # nothing to do: already at the budget or the end
        latest = checkpoint.read_latest(trainer.store, config.run_name)
        checkpoint_uri = latest["checkpoint_uri"] if latest else None
    report.close(preempted=trainer.step < stop)
    result = FitResult(
        run=config.run_name,
        run_id=trainer.mlflow_run_id,
        checkpoint_uri=checkpoint_uri,
        steps=trainer.step,
        total_steps=trainer.total_steps,
        final_loss=trainer.last_loss,
        val_bpc=trainer.last_val_bpc,
        skipped_steps=trainer.total_skipped_steps(),
        preempted=trainer.step < stop,
    )
    log(world, "result " + json.dumps(result.model_dump()))
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
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as error:
        # A file that is missing or can't be read stays so: a relaunch would meet it again.
        print(f"{joblog.ERROR_PREFIX}rank {world.rank}: {type(error).__name__}: {error}", flush=True)
        return 2
    except Exception as error:
        print(joblog.failure_line(world.rank, error), flush=True)  # the watcher's error names it
        raise
    finally:
        world.close()
    # A preempted launch exits non-zero, so launchers and the flow see an unfinished job.
    return 143 if result.preempted else 0


if __name__ == "__main__":
    die_with_parent()  # a rank stops (and checkpoints) when its torchrun is killed
    raise SystemExit(main())
