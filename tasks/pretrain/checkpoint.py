"""Checkpoints in the store: ``runs/<run>/checkpoints/step-NNNNNNN/`` and ``runs/<run>/latest.json``.

A checkpoint folder holds ``state.pt`` (weights, optimizer, scaler, schedule, the carried hidden state
and RNG state, loaded with ``weights_only=True``: no pickled code) and ``meta.json`` (the model config,
the training config, the step and its metrics, and the sha256 of ``state.pt``). ``latest.json`` is written
last, so a reader never finds a half-written checkpoint through it.

A ``state.pt`` that a full disk or a killed copy cut short, or that rotted in the store, no longer matches
the digest in its ``meta.json`` (or, in an older checkpoint without one, no longer loads): loading it raises
``DamagedCheckpoint`` naming the file, and ``load_intact`` falls back to the newest intact step of the run.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from models.mlstm import MLSTM, MLSTMConfig
from tasks.store import Store, StoreError, open_store

log = logging.getLogger(__name__)

LATEST = "latest.json"
STATE_FILE = "state.pt"
_STEP_DIR = re.compile(r"step-(\d{7,})$")


class DamagedCheckpoint(ValueError):
    """A checkpoint file that does not match its recorded sha256 or cannot be read: no retry mends it."""


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
    with store.writer(f"{prefix}/{STATE_FILE}") as path:
        with path.open("wb") as file:
            torch.save(state, file)
        # Of the bytes as written here: a copy or a disk that cuts the published file short shows on load.
        with path.open("rb") as file:
            meta["sha256"] = {STATE_FILE: hashlib.file_digest(file, "sha256").hexdigest()}
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
    """The checkpoint in the folder ``prefix`` of a store ("" for the store's root).

    Raises ``DamagedCheckpoint`` when ``state.pt`` does not match the sha256 recorded in ``meta.json``
    or (a checkpoint saved before digests were recorded) cannot be unpickled.
    """

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    for name in ("meta.json", STATE_FILE):
        if not store.exists(key(name)):
            raise StoreError(f"{store.url(prefix)} is not a checkpoint: it has no {name}")
    meta = json.loads(store.read_bytes(key("meta.json")))
    state_url = store.url(key(STATE_FILE))
    with store.open_read(key(STATE_FILE)) as stream:
        data = stream.read()
    expected = meta.get("sha256", {}).get(STATE_FILE)
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise DamagedCheckpoint(
            f"{state_url} is damaged: its {len(data):,} bytes do not match the sha256 in its meta.json"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError) as error:
        raise DamagedCheckpoint(f"{state_url} is damaged: it cannot be read ({error})") from error
    return Checkpoint(store.url(prefix) if prefix else store.uri, meta, state)


def run_steps(store: Store, run: str) -> list[int]:
    """The steps of a run that have a checkpoint folder, newest first."""
    steps = set()
    for key in store.list(f"{run_prefix(run)}/checkpoints"):
        match = _STEP_DIR.search(key.rpartition("/")[0])
        if match and key.endswith(f"/{STATE_FILE}"):
            steps.add(int(match.group(1)))
    return sorted(steps, reverse=True)


def load_intact(
    store: Store, run: str, *, map_location: str | torch.device = "cpu"
) -> tuple[Checkpoint, list[str]] | None:
    """The run's newest intact checkpoint (from ``latest.json``'s step down) and the damaged files
    skipped on the way; None for a run without ``latest.json``. No intact one: ``DamagedCheckpoint``
    naming every damaged file."""
    latest = read_latest(store, run)
    if latest is None:
        return None
    newest = int(latest["step"])
    damaged: list[str] = []
    for step in [newest, *(s for s in run_steps(store, run) if s < newest)]:
        try:
            return load_from(store, step_prefix(run, step), map_location=map_location), damaged
        except DamagedCheckpoint as error:
            damaged.append(str(error))
    raise DamagedCheckpoint(
        f"run {run} has no intact checkpoint to resume from: "
        + "; ".join(damaged)
        + " (choose a new --run, or restore the files)"
    )


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
    try:
        return load_from(store, latest["checkpoint"], map_location=map_location)
    except DamagedCheckpoint as error:
        # The run's folder, not one step, was asked for: its newest intact step answers, with a warning.
        run_store = open_store(uri.rsplit("/", 2)[0], **store_options)
        found = load_intact(run_store, uri.rsplit("/", 1)[1], map_location=map_location)
        assert found is not None
        log.warning("%s; using %s instead", error, found[0].uri)
        return found[0]
