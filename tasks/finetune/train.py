"""The fine-tuning job: ``torchrun --nproc-per-node N -m tasks.finetune.train --checkpoint URI --dataset
NAME=PATH --run-name NAME``.

The pretraining job's machinery around another model and another data path: ranks, DDP and SIGTERM
from ``tasks.jobs.world``, Adam from ``tasks.jobs.sharding.wrap`` (built by ``tasks.jobs.optim``), autocast from
``models.precision``, checkpoints and their exact resume from ``tasks.jobs.checkpointer``.
What is its own: the data (each epoch's batches a function of the seed and the epoch: rows shuffled,
then sorted by length within groups of batches, so where a step reads is a function of the step alone
and a relaunch resumes exactly, with any number of ranks that divides the batch), the slanted
triangular learning rate of Howard & Ruder (2018), and the choice on dev: at each epoch's end the dev
split picks a threshold, and the epoch best on dev is the classifier the run hands on; test is scored
once, at the end, with that one.

Checkpoints go to ``<store>/finetune/runs/<run>/``, a folder of their own, so that a pretraining
``--checkpoint newest`` never finds a fine-tuning run. Each epoch's classifier (threshold folded in)
is saved at ``…/runs/<run>/epochs/epoch-NNN/``; ``result.json`` last.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from models.classifier import CONFIG_FILE, WEIGHTS_FILE
from models.finetuned import FinetunedClassifier, FinetuneModel, HeadConfig, batch_bytes
from models.precision import autocast, resolve_precision
from models.text import encode
from tasks.finetune.config import FinetuneConfig, weight_settings
from tasks.jobs import joblog
from tasks.jobs import sharding as shard
from tasks.jobs.checkpoint import load_checkpoint, run_prefix
from tasks.jobs.checkpointer import Checkpointer
from tasks.jobs.config import neutral_values, weight_marks
from tasks.jobs.torchrun import die_with_parent
from tasks.jobs.world import Preempted, World, log
from tasks.settings import Settings, get_settings
from tasks.store import Store, open_store
from tasks.transfer.datasets import Dataset, load_dataset

FOLDER = "finetune"  # under the store: fine-tuning runs beside, never among, the pretraining runs
RESULT = "result.json"


def finetune_store(uri: str, settings: Settings) -> Store:
    return open_store(
        f"{uri.rstrip('/')}/{FOLDER}",
        endpoint_url=settings.s3_endpoint_url,
        max_attempts=settings.s3_max_attempts,
    )


def slanted_triangular(step: int, *, total_steps: int, cut_frac: float, ratio: float) -> float:
    """Howard & Ruder (2018), eq. 3: the factor of the peak learning rate at ``step``. It rises linearly
    for the first ``cut_frac`` of the steps from 1/ratio to 1, then falls linearly back to 1/ratio."""
    cut = max(1, math.floor(total_steps * cut_frac))
    p = step / cut if step < cut else 1 - (step - cut) / max(1, total_steps - cut)
    return (1 + max(0.0, p) * (ratio - 1)) / ratio


def epoch_batches(lengths_N: np.ndarray, batch_size: int, *, seed: int, epoch: int, group: int) -> np.ndarray:
    """The rows of each step of an epoch [steps, batch_size]: a function of (seed, epoch) alone.

    The rows are shuffled; the last partial batch is left out. With ``group`` > 1 each run of ``group``
    batches' rows is sorted by length (stable) and cut into batches, whose order is then shuffled: a
    batch's texts are of like length (little padding), yet which texts meet, and in which order the
    lengths come, still changes every epoch (fastai's SortishSampler)."""
    rng = np.random.default_rng([seed, epoch])
    steps = len(lengths_N) // batch_size
    order = rng.permutation(len(lengths_N))[: steps * batch_size]
    if group == 1:
        return order.reshape(steps, batch_size)
    for start in range(0, len(order), group * batch_size):
        chunk = order[start : start + group * batch_size]
        order[start : start + len(chunk)] = chunk[np.argsort(lengths_N[chunk], kind="stable")]
    return order.reshape(steps, batch_size)[rng.permutation(steps)]


def pick_threshold(z_N: np.ndarray, y_N: np.ndarray) -> tuple[float, float]:
    """The logit threshold τ with the best dev accuracy (``z ≥ τ`` is positive), and that accuracy.
    Candidates: 0 and the midpoints between sorted logits; of equals, the nearest to 0 (P = 0.5)."""
    z = np.sort(z_N)
    candidates = np.concatenate([[0.0], (z[1:] + z[:-1]) / 2, [z[0] - 1.0, z[-1] + 1.0]])
    accuracy = ((z_N[None, :] >= candidates[:, None]) == y_N[None, :].astype(bool)).mean(axis=1)
    best = np.flatnonzero(accuracy == accuracy.max())
    chosen = best[np.argmin(np.abs(candidates[best]))]
    return float(candidates[chosen]), float(accuracy[chosen])


def param_groups(model: torch.nn.Module, lr: float, lm_factor: float) -> list[dict[str, Any]]:
    """Adam's param groups: the head's at ``lr`` (first: the one whose rate is logged), the mLSTM's
    (``lm.``) at ``lm_factor`` × ``lr``; the schedule scales each group's own rate, so the ratio holds at
    every step. One group when the factor is 1, as runs saved before the factor existed have."""
    if lm_factor == 1:
        return [{"params": list(model.parameters()), "lr": lr}]
    named = list(model.named_parameters())
    head = [p for name, p in named if not name.startswith("lm.")]
    lm = [p for name, p in named if name.startswith("lm.")]
    return [{"params": head, "lr": lr}, {"params": lm, "lr": lr * lm_factor}]


class Trainer:
    """One run: the model, its optimizer and schedule, the rows of each step, the epochs so far."""

    def __init__(self, config: FinetuneConfig, world: World, settings: Settings) -> None:
        self.config, self.world, self.settings = config, world, settings
        self.store = finetune_store(config.store or settings.resolved_store_uri, settings)
        self.data: Dataset = load_dataset(
            config.dataset, text_column=config.text_column, label_column=config.label_column
        )
        B, W = config.batch_size, world.size
        if B % W:
            raise ValueError(f"--batch-size {B} is not a multiple of the {W} ranks that share it")
        self.steps_per_epoch = len(self.data.train) // B  # the last partial batch is left out
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"--batch-size {B} is larger than the {len(self.data.train)} rows of {self.data.name}'s train split"
            )
        self.total_steps = config.epochs * self.steps_per_epoch
        # Each text's bytes as read (cut to max_bytes): what orders the rows into batches.
        self.lengths_N = np.array(
            [min(len(encode(text)), config.max_bytes) for text in self.data.train.texts], dtype=np.int64
        )
        self._epoch: tuple[int, np.ndarray] | None = None  # the batches of the epoch last read
        self.dtype = resolve_precision(config.precision, world.device)

        pretrained = load_checkpoint(config.checkpoint, endpoint_url=settings.s3_endpoint_url)
        self.checkpoint_uri, self.checkpoint_run_id = pretrained.uri, pretrained.meta.get("mlflow_run_id")
        world.take_threads(pretrained.model_config.hidden_size)
        torch.manual_seed(config.seed)  # the same head on every rank
        head = HeadConfig(
            pool=config.pool,
            head=config.head,
            mlp_hidden=config.mlp_hidden,
            max_bytes=config.max_bytes,
            truncate=config.truncate,
        )
        self.model = FinetuneModel(pretrained.model(), head).to(world.device)
        # Frozen weights get no gradient, so Adam never moves them: the mLSTM with --freeze-lm, and its
        # next-byte read-out when no auxiliary loss trains it.
        for parameter in self.model.lm.parameters():
            parameter.requires_grad_(not config.freeze_lm)
        self.model.lm.out.requires_grad_(config.aux_lm_weight > 0)
        self.ddp, self.optimizer = shard.wrap(
            self.model, "none", world_size=W, device=world.device, dtype=self.dtype, optimizer=config,
            lr=config.lr, params=lambda model: param_groups(model, config.lr, config.lm_lr_factor),
        )  # fmt: skip
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: slanted_triangular(
                step, total_steps=self.total_steps, cut_frac=config.lr_cut_frac, ratio=config.lr_ratio
            ),
        )
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
            graphed=False,
        )
        self.step = 0
        self.epochs: list[dict[str, Any]] = []  # one record per finished epoch (rank 0's)
        self.sums = [0.0, 0.0, 0.0]  # this epoch's classification loss, LM loss, steps: for its means
        self.mlflow_run_id = config.mlflow_run_id

    # No hidden state carries from step to step here (each text is read from a zero state): the
    # checkpointer's carried-state rows hold one placeholder row per rank.
    def _no_carry(self) -> tuple[Tensor, Tensor]:
        return torch.zeros(1, 1, device=self.world.device), torch.zeros(1, 1, device=self.world.device)

    def resume(self) -> bool:
        saved = self.checkpoints.resume(
            self.config.model_dump(include=set(weight_marks(type(self.config)))),
            self.total_steps,
            neutral=neutral_values(type(self.config)),
        )
        if saved is None:
            return False
        self.step = saved.step
        self.epochs, self.sums = saved.meta["epochs"], saved.meta["sums"]
        self.mlflow_run_id = self.mlflow_run_id or saved.meta.get("mlflow_run_id")
        return True

    def save(self) -> str | None:
        meta = {
            "config": self.config.model_dump(),
            "total_steps": self.total_steps,
            "epochs": self.epochs,
            "sums": self.sums,
            "pretrained": self.checkpoint_uri,
            "mlflow_run_id": self.mlflow_run_id,
            "world_size": self.world.size,
        }
        return self.checkpoints.save(self.step, self._no_carry(), meta)

    def rows(self, step: int) -> np.ndarray:
        """This rank's rows of the train split at ``step``: its share of the step's global batch."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            batches = epoch_batches(
                self.lengths_N, self.config.batch_size, seed=self.config.seed, epoch=epoch,
                group=self.config.sort_batches,
            )  # fmt: skip
            self._epoch = (epoch, batches)
        B, W, k = self.config.batch_size, self.world.size, self.world.rank
        return self._epoch[1][index][k * B // W : (k + 1) * B // W]

    def train_step(self) -> tuple[float, float]:
        """One step: returns this rank's classification and LM losses (nats)."""
        rows = self.rows(self.step)
        bytes_BT, lengths_B = batch_bytes(
            [self.data.train.texts[r] for r in rows], self.config.max_bytes, self.config.truncate
        )
        y_B = torch.from_numpy(self.data.train.labels[rows]).float().to(self.world.device)
        self.ddp.train()
        with autocast(self.world.device, self.dtype):
            z_B, lm_B = self.ddp(bytes_BT.to(self.world.device), lengths_B.to(self.world.device))
        classification = F.binary_cross_entropy_with_logits(z_B.float(), y_B)
        lm = lm_B.mean()
        loss = (
            classification + self.config.aux_lm_weight * lm if self.config.aux_lm_weight else classification
        )
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(trainable, self.config.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        self.step += 1
        return float(classification.detach()), float(lm.detach())

    def end_epoch(self, tracker: Any) -> dict[str, Any]:
        """The epoch's means over the ranks; on rank 0, dev picks a threshold and the epoch's classifier
        is saved. Returns the epoch's record (rank 0's is the one kept)."""
        epoch = self.step // self.steps_per_epoch
        clf, lm, steps = self.world.sum(self.sums)
        steps = max(steps, 1.0)
        record: dict[str, Any] = {
            "epoch": epoch,
            "step": self.step,
            "train_loss": clf / steps,
            "aux_lm_loss": lm / steps,
            "lr": float(self.schedule.get_last_lr()[0]),
        }
        self.sums = [0.0, 0.0, 0.0]
        if not self.world.is_main:
            return record
        # fp32 on every device: the epoch and threshold are chosen, and test read, on exact logits.
        z_N = self.model.logits(self.data.dev.texts, precision="fp32")
        threshold, dev_accuracy = pick_threshold(z_N, self.data.dev.labels)
        key = self.export(epoch, threshold)
        record |= {
            "dev_accuracy": dev_accuracy,
            "threshold": threshold,
            "key": key,
            "uri": self.store.url(key),
        }
        self.epochs.append(record)
        log(self.world, "epoch " + json.dumps(record))
        if tracker is not None:
            metrics = {k: record[k] for k in ("train_loss", "dev_accuracy", "aux_lm_loss", "lr", "threshold")}
            tracker.log_metrics(metrics, step=epoch, run_id=self.mlflow_run_id)
        return record

    def classifier(self, threshold: float) -> FinetunedClassifier:
        """A copy of the model as it is now, the threshold folded into its head, with its provenance."""
        model = copy.deepcopy(self.model).cpu()
        model.fold_threshold(threshold)
        info = {
            "method": "finetune",
            "checkpoint_uri": self.checkpoint_uri,
            "dataset": self.data.name,
            "checksum": self.data.checksum,
            "settings": self.config.model_dump(include=set(weight_settings())),
            "threshold_logit": threshold,
            "run": self.config.run_name,
        }
        return FinetunedClassifier(model, info)

    def export(self, epoch: int, threshold: float) -> str:
        """Save the epoch's classifier in the store; its key there."""
        prefix = f"{run_prefix(self.config.run_name)}/epochs/epoch-{epoch:03d}"
        with tempfile.TemporaryDirectory(prefix="mlstm-finetune-") as scratch:
            folder = self.classifier(threshold).save(Path(scratch))
            for file in sorted(folder.iterdir()):
                self.store.put_file(file, f"{prefix}/{file.name}")
        return prefix

    def best_epoch(self) -> dict[str, Any]:
        """The epoch best on dev; of equals, the earliest."""
        return max(self.epochs, key=lambda e: (e["dev_accuracy"], -e["epoch"]))


def load_classifier(store: Store, key: str) -> FinetunedClassifier:
    """A saved epoch's classifier, from its key in the fine-tuning store."""
    with tempfile.TemporaryDirectory(prefix="mlstm-finetune-") as scratch:
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            (Path(scratch) / name).write_bytes(store.read_bytes(f"{key}/{name}"))
        return FinetunedClassifier.load(Path(scratch))


def start_tracker(trainer: Trainer) -> Any:
    """Rank 0's MLflow run (the flow's, or a new one), its params the settings the weights depend on."""
    import mlflow

    from tasks.tracking import start_tracking

    config = trainer.config
    run = start_tracking(
        trainer.settings,
        run_id=trainer.mlflow_run_id,
        run_name=f"finetune-{config.run_name}",
        tags={"stage": "finetune", "run": config.run_name, "checkpoint_uri": trainer.checkpoint_uri},
    )
    trainer.mlflow_run_id = run.info.run_id
    params = {**config.model_dump(include=set(weight_settings())), "total_steps": trainer.total_steps}
    with contextlib.suppress(mlflow.exceptions.MlflowException):  # a resume logs the same values again
        mlflow.log_params(params)
    return mlflow


def fit(config: FinetuneConfig, world: World, settings: Settings) -> dict[str, Any]:
    trainer = Trainer(config, world, settings)
    resumed = trainer.resume()
    stop = min(trainer.total_steps, config.max_steps or trainer.total_steps)
    tracker = start_tracker(trainer) if world.is_main and config.tracking == "mlflow" else None
    preempted = Preempted(world)
    log(
        world,
        f"run {config.run_name}: {config.head} head on {config.pool} pooling, {world.size} rank(s) on "
        f"{world.device.type}, {str(trainer.dtype).removeprefix('torch.')}, {trainer.data.name}: "
        f"{len(trainer.data.train)} train rows, batch {config.batch_size}, steps {trainer.step}→{stop} of "
        f"{trainer.total_steps}" + (" (resumed)" if resumed else ""),
    )
    while trainer.step < stop:
        clf, lm = trainer.train_step()
        trainer.sums = [trainer.sums[0] + clf, trainer.sums[1] + lm, trainer.sums[2] + 1]
        step = trainer.step
        stopping = preempted.stops_after(step, stop)
        epoch_end = step % trainer.steps_per_epoch == 0
        if step % config.log_every == 0 or step == stop:
            loss = world.sum([clf])[0] / world.size
            lr = float(trainer.schedule.get_last_lr()[0])
            log(world, joblog.progress_line({"step": step, "loss": loss, "aux_lm_loss": lm, "lr": lr}))
        if epoch_end:
            trainer.end_epoch(tracker)
        if step % config.checkpoint_every == 0 or epoch_end or step == stop or stopping:
            trainer.save()
        if stopping:
            log(world, joblog.stopped_line(step))
            break
    result: dict[str, Any] = {
        "run": config.run_name,
        "run_id": trainer.mlflow_run_id,
        "steps": trainer.step,
        "total_steps": trainer.total_steps,
        "preempted": trainer.step < stop,
        "checkpoint_uri": trainer.checkpoint_uri,
    }
    if world.is_main and trainer.step == trainer.total_steps and trainer.epochs:
        best = trainer.best_epoch()
        # The test split is read once, by the classifier the run hands on; timed, since on a large test
        # split in fp32 it is much of the run (the benchmark records it).
        started = time.perf_counter()
        p_N = load_classifier(trainer.store, best["key"]).predict_proba(
            trainer.data.test.texts, precision="fp32"
        )
        test_accuracy = float(((p_N >= 0.5) == trainer.data.test.labels.astype(bool)).mean())
        result |= {
            "epochs": trainer.epochs,
            "best_epoch": best["epoch"],
            "dev_accuracy": best["dev_accuracy"],
            "threshold": best["threshold"],
            "classifier_uri": best["uri"],
            "classifier_key": best["key"],
            "test_accuracy": test_accuracy,
            "test_seconds": time.perf_counter() - started,
            "dataset": trainer.data.name,
            "checksum": trainer.data.checksum,
            "checkpoint_run_id": trainer.checkpoint_run_id,
            "rows": {name: len(split) for name, split in trainer.data.splits().items()},
        }
        trainer.store.write_bytes(
            f"{run_prefix(config.run_name)}/{RESULT}", json.dumps(result, indent=2).encode()
        )
        if tracker is not None:
            tracker.log_metrics({"test_accuracy": test_accuracy, "best_epoch": best["epoch"]})
    if tracker is not None:
        tracker.end_run("KILLED" if result["preempted"] else "FINISHED")
    log(world, "result " + json.dumps(result))
    world.barrier()  # every rank waits for rank 0's files and MLflow before the group goes
    return result


def main(argv: list[str] | None = None) -> int:
    config = FinetuneConfig.from_args(sys.argv[1:] if argv is None else argv)
    world = World.from_env()
    try:
        result = fit(config, world, get_settings())
    except ValueError as error:  # a dataset or a setting: a relaunch would meet it again
        log(world, f"{joblog.ERROR_PREFIX}{error}")
        return 2
    except Exception as error:
        print(joblog.failure_line(world.rank, error), flush=True)
        raise
    finally:
        world.close()
    return 143 if result["preempted"] else 0


if __name__ == "__main__":
    die_with_parent()
    raise SystemExit(main())
