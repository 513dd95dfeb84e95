"""A training run's checkpoints: what of its state each one holds, and how a relaunch takes it back.

``tasks.jobs.checkpoint`` is the files in the store; this is the run's side of them. A checkpoint
holds the weights and Adam's state (whole, or each rank's share as DCP files where the state is
sharded), the schedule, the loss scale, the carried hidden state of every row and the RNG state. It is
the same file whichever way the step ran: learning rates as numbers and Adam's default flags, though a
captured step's Adam holds its lr as a device tensor and runs fused and capturable. A resume puts each
piece back into this launch's model and optimizer, at any world size and sharding, and refuses a run
whose numbers would change: a setting they depend on, or the length of the schedule.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.mlstm import State
from tasks.jobs import checkpoint, joblog
from tasks.jobs import sharding as shard
from tasks.jobs.world import World, log
from tasks.store import Store

# How Adam runs, besides its hyperparameters: a checkpoint's say how it ran, not how a launch runs.
ADAM_FLAGS = ("fused", "capturable", "foreach")


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


def changed_settings(
    saved: dict[str, Any], launch: dict[str, Any], neutral: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """The settings whose value in this launch (``launch``) differs from the checkpoint's (``saved``, its
    config), as (saved, launch) pairs. A setting the checkpoint lacks was added since: it ran with the
    setting's neutral value where the setting declares one, else counts as None (and is refused)."""
    changed = {}
    for name, value in launch.items():
        old = saved[name] if name in saved else neutral.get(name)
        if old != value:
            changed[name] = (old, value)
    return changed


@dataclasses.dataclass
class Checkpointer:
    """Saves one run's training state to the store, and puts it back on a relaunch."""

    store: Store
    run: str
    world: World
    scratch: Path  # a local folder for DCP files on their way to or from the store
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    graphed: bool  # the optimizer is a captured step's: lr a device tensor, fused and capturable

    def save(self, step: int, carried: State, meta: dict[str, Any]) -> str | None:
        """Every rank gathers the carried state; rank 0 writes (each rank its share of a sharded
        state, through DCP). Returns the URI on rank 0."""
        started = time.perf_counter()
        h, c = (self.world.gather_rows(t.detach()) for t in carried)
        if shard.is_sharded(self.model, self.optimizer):
            return self._save_sharded(step, h, c, meta, started)
        weights, optimizer_state = shard.full_state(self.model, self.optimizer)
        if not self.world.is_main:
            return None
        # The same file whether the step was captured or not: lr a number, Adam's defaults.
        optimizer_state["param_groups"] = plain_lr(optimizer_state["param_groups"])
        if self.graphed:
            optimizer_state["param_groups"] = [
                {**g, "fused": None, "capturable": False} for g in optimizer_state["param_groups"]
            ]
        state = {"model": weights, "optimizer": optimizer_state, **self._run_state(h, c)}
        uri = checkpoint.save_checkpoint(self.store, self.run, step, state, meta)
        log(self.world, f"checkpoint step={step} uri={uri} in {time.perf_counter() - started:.2f} s")
        return uri

    def _save_sharded(
        self, step: int, h: Tensor, c: Tensor, meta: dict[str, Any], started: float
    ) -> str | None:
        """Each rank writes its share of the weights and Adam's state (DCP) into its own scratch
        folder and copies it into the store; once all have, rank 0 writes the rest, ``meta.json``
        with every file's sha256, then ``latest.json``."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            prefix=f"{self.run}-{step}-rank{self.world.rank}-", dir=self.scratch
        ) as folder:
            shard.save_sharded(self.model, self.optimizer, Path(folder))
            rank_files = checkpoint.save_shards(self.store, self.run, step, Path(folder))
        every_rank_files: list[dict[str, str] | None] = [None] * self.world.size
        dist.all_gather_object(every_rank_files, rank_files)  # also: every rank's files are in the store
        if not self.world.is_main:
            return None
        run_state = {**shard.optimizer_layout(self.model, self.optimizer), **self._run_state(h, c)}
        files = {name: digest for part in every_rank_files for name, digest in (part or {}).items()}
        uri = checkpoint.save_sharded_checkpoint(self.store, self.run, step, run_state, files, meta)
        seconds = time.perf_counter() - started
        log(
            self.world,
            f"checkpoint step={step} uri={uri} in {seconds:.2f} s (sharded: {len(files)} DCP files)",
        )
        return uri

    def _run_state(self, h: Tensor, c: Tensor) -> dict[str, Any]:
        """Everything but the weights and Adam's state."""
        return {
            "schedule": plain_lr(self.schedule.state_dict()),
            "scaler": self.scaler.state_dict(),
            "h": h.cpu(),
            "c": c.cpu(),
            "rng": torch.get_rng_state(),
        }

    def resume(
        self, run_settings: dict[str, Any], total_steps: int, *, neutral: Mapping[str, Any]
    ) -> checkpoint.Checkpoint | None:
        """Load the run's newest intact checkpoint into the model, optimizer, schedule, scaler and RNG,
        and return it (the carried state and the step's counters are the caller's to take); None for a
        new run. ``run_settings``: this launch's values of the settings the run's numbers depend on;
        ``neutral``: the value of each setting added later that trains as before it existed, which a
        checkpoint saved without that setting is read as having (``tasks.jobs.config.neutral_values``)."""
        # A sharded checkpoint's DCP files, where a store is not a folder they can be read in place.
        # One folder a rank: a node's ranks do not wait on each other to download.
        shards_to = self.scratch / f"{self.run}-rank{self.world.rank}"
        started = time.perf_counter()
        if self.world.is_main:  # before any save of this launch: a killed one's half-written files go
            for key in self.store.remove_partial(checkpoint.run_prefix(self.run)):
                log(self.world, f"removed {key}, a checkpoint file a killed launch left half-written")
        found = checkpoint.load_intact(self.store, self.run, shards_to=shards_to)
        if found is None:
            return None
        saved, damaged = found
        if damaged:
            log(
                self.world,
                f"{joblog.WARNING_PREFIX}{'; '.join(damaged)}; resuming from step {saved.step} ({saved.uri})",
            )
        self._check_same_run(
            saved, changed_settings(saved.meta["config"], run_settings, neutral), total_steps
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
        self._load_weights_and_adam(saved)
        if saved.sharded is not None:
            shutil.rmtree(shards_to, ignore_errors=True)  # a download's copy (a folder store's files stay)
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        seconds = time.perf_counter() - started
        log(self.world, joblog.resumed_line(self.run, saved.step, saved.uri, seconds))
        return saved

    def start_from(self, parent: checkpoint.Checkpoint, *, optimizer: bool) -> None:
        """Another run's weights as this new run's start (with ``optimizer``, Adam's moments and step
        counts too). Its learning rates, Adam's settings, the schedule, the scaler and the carried state
        stay this run's own: a continued run re-warms and re-decays on a schedule of its own."""
        if not optimizer:
            shard.load_full_weights(self.model, parent.state["model"])
            return
        own = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._load_weights_and_adam(parent)
        for group, settings, lr in zip(self.optimizer.param_groups, own, lrs, strict=True):
            group.update(settings)  # a captured step's lr is the same tensor again: filled with this run's
            if isinstance(group["lr"], Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def _check_same_run(
        self, saved: checkpoint.Checkpoint, mismatched: dict[str, tuple[Any, Any]], total_steps: int
    ) -> None:
        if mismatched:
            changes = ", ".join(
                f"--{k.replace('_', '-')} was {old!r}, now {new!r}" for k, (old, new) in mismatched.items()
            )
            raise ValueError(
                f"run {self.run!r} was started with other settings ({changes}): "
                "relaunch with the same settings, or choose a new --run"
            )
        if saved.meta["total_steps"] != total_steps:
            raise ValueError(
                f"run {self.run!r} has a schedule of {saved.meta['total_steps']} steps, this launch "
                f"{total_steps}: relaunch with --total-steps {saved.meta['total_steps']}"
            )

    def _load_weights_and_adam(self, saved: checkpoint.Checkpoint) -> None:
        """The weights and Adam's state into this launch's model and optimizer, Adam still running the
        way this launch runs it: a captured step's keeps its lr tensors and its flags."""
        state = saved.state
        launch_groups = (
            [(group["lr"], {k: group[k] for k in ADAM_FLAGS}) for group in self.optimizer.param_groups]
            if self.graphed
            else []
        )
        if saved.sharded is not None:  # DCP files: each rank reads its share, resharded to this launch
            shard.load_sharded(self.model, self.optimizer, saved.sharded)
            for group, saved_group in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
                group["lr"] = saved_group["lr"]  # this launch's param groups, at the saved step's lr
        else:
            if launch_groups:
                # Loaded with this launch's flags, so Adam puts each parameter's step count on the device,
                # where fused, capturable Adam reads it (the file's flags would leave it on the CPU).
                state["optimizer"] = {
                    **state["optimizer"],
                    "param_groups": [
                        {**saved_group, **flags}
                        for saved_group, (_, flags) in zip(
                            state["optimizer"]["param_groups"], launch_groups, strict=True
                        )
                    ],
                }
            shard.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        for group, (lr, flags) in zip(self.optimizer.param_groups, launch_groups, strict=False):
            if isinstance(lr, Tensor):
                group["lr"] = lr.fill_(float(group["lr"]))  # the tensor the graph reads, at the saved lr
            group.update(flags)
