"""Checkpoints in the store: ``runs/<run>/checkpoints/step-NNNNNNN/`` and ``runs/<run>/latest.json``.

A checkpoint folder holds ``state.pt`` (weights, optimizer, scaler, schedule, the carried hidden state
and RNG state, loaded with ``weights_only=True``: no pickled code) and ``meta.json`` (the model config,
the training config, the step and its metrics). ``latest.json`` is written last, so a reader never
finds a half-written checkpoint through it.
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from models.mlstm import MLSTM, MLSTMConfig
from tasks.store import Store, StoreError, open_store

LATEST = "latest.json"
_STEP_DIR = re.compile(r"step-(\d{7,})$")


def run_prefix(run: str) -> str:
    return f"runs/{run}"


def step_prefix(run: str, step: int) -> str:
    return f"{run_prefix(run)}/checkpoints/step-{step:07d}"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: where it is, what it says about itself, and its tensors."""

    uri: str
    meta: dict[str, Any]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def model_config(self) -> MLSTMConfig:
        return MLSTMConfig(**self.meta["model"])

    def model(self) -> MLSTM:
        model = MLSTM(self.model_config)
        model.load_state_dict(self.state["model"])
        return model


def save_checkpoint(store: Store, run: str, step: int, state: dict[str, Any], meta: dict[str, Any]) -> str:
    """Write a step's checkpoint, then point ``latest.json`` at it. Returns the checkpoint's URI."""
    prefix = step_prefix(run, step)
    meta = {**meta, "step": step, "run": run}
    with store.writer(f"{prefix}/state.pt") as path, path.open("wb") as file:
        torch.save(state, file)
    store.write_bytes(f"{prefix}/meta.json", json.dumps(meta, indent=2).encode())
    uri = store.url(prefix)
    saved_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    latest = {
        "step": step,
        "checkpoint": f"checkpoints/step-{step:07d}",
        "checkpoint_uri": uri,
        "saved_at": saved_at,
        **meta,
    }
    store.write_bytes(f"{run_prefix(run)}/{LATEST}", json.dumps(latest, indent=2).encode())
    return uri


def read_latest(store: Store, run: str) -> dict[str, Any] | None:
    """The run's ``latest.json``, or None for a run that has no checkpoint yet."""
    key = f"{run_prefix(run)}/{LATEST}"
    return json.loads(store.read_bytes(key)) if store.exists(key) else None


def newest_checkpoint(store: Store) -> str | None:
    """The checkpoint of the run saved last in the store (what a nightly re-evaluation reads)."""
    newest: tuple[str, str] | None = None
    for key in store.list("runs"):
        if key.endswith(f"/{LATEST}") and key.count("/") == 2:
            latest = json.loads(store.read_bytes(key))
            candidate = (latest.get("saved_at", ""), latest["checkpoint_uri"])
            newest = max(newest, candidate) if newest else candidate
    return newest[1] if newest else None


def load_from(store: Store, prefix: str, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """The checkpoint in the folder ``prefix`` of a store ("" for the store's root)."""

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    for name in ("meta.json", "state.pt"):
        if not store.exists(key(name)):
            raise StoreError(f"{store.url(prefix)} is not a checkpoint: it has no {name}")
    meta = json.loads(store.read_bytes(key("meta.json")))
    with store.open_read(key("state.pt")) as stream:
        state = torch.load(io.BytesIO(stream.read()), map_location=map_location, weights_only=True)
    return Checkpoint(store.url(prefix) if prefix else store.uri, meta, state)


def load_checkpoint(
    uri: str, *, map_location: str | torch.device = "cpu", **store_options: Any
) -> Checkpoint:
    """A checkpoint by URI: a step folder, a run folder or its ``latest.json`` (then the latest step)."""
    uri = uri.rstrip("/")
    if uri.endswith(f"/{LATEST}"):
        uri = uri.removesuffix(f"/{LATEST}")
    if _STEP_DIR.search(uri):
        return load_from(open_store(uri, **store_options), "", map_location=map_location)
    store = open_store(uri, **store_options)
    if not store.exists(LATEST):
        raise StoreError(
            f"{uri} is neither a checkpoint folder (…/checkpoints/step-NNNNNNN) nor a run with a "
            f"{LATEST}: pass the checkpoint_uri that `mlstm-sentiment pretrain` printed"
        )
    latest = json.loads(store.read_bytes(LATEST))
    return load_from(store, latest["checkpoint"], map_location=map_location)
