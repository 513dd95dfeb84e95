"""Checkpoints in the store: ``runs/<run>/checkpoints/step-NNNNNNN/`` and ``runs/<run>/latest.json``.

A checkpoint folder holds ``state.pt`` (weights, optimizer, scaler, schedule, the carried hidden state
and RNG state, loaded with ``weights_only=True``: no pickled code) and ``meta.json`` (the model config,
the training config, the step and its metrics, and the sha256 of ``state.pt``). ``latest.json`` is written
last, so a reader never finds a half-written checkpoint through it.

A ``state.pt`` that a full disk or a killed copy cut short, or that rotted in the store, no longer matches
the digest in its ``meta.json`` (or, in an older checkpoint without one, no longer loads): loading it raises
``DamagedCheckpoint`` naming the file, and ``load_intact`` falls back to the newest intact step of the run.

A job whose state is sharded (``--sharding optimizer|full`` on more than one rank) saves a sharded
checkpoint instead: ``sharded/`` holds ``torch.distributed.checkpoint`` (DCP) files, each rank writing its
own share of the weights and Adam state, and ``run_state.pt`` the rest (schedule, scaler, carried state,
RNG, Adam's hyperparameters); ``meta.json`` says ``"format": "dcp"`` and holds the sha256 of every file.
A resume at any world size and sharding reads the DCP files in place (DCP reshards them). Every other
reader (the transfer stage, ``features``, the registry, ``explain``) gets a consolidated ``state.pt``:
``load_from`` consolidates a sharded checkpoint on first use, in one process, and caches the file in the
step's folder (with ``consolidated.json`` holding its sha256) when the store can be written.

Every ``meta.json`` (and so every file's sha256 in it) also carries an HMAC-SHA256 under the
installation's key (``tasks/signing.py``: ``MLSTM_CHECKPOINT_KEY``, else a key made on first use under
``MLSTM_HOME``), which ``load_from``, the one way in for every reader, checks before it opens any other
file of the checkpoint. DCP's files are also read as data only (``tasks/jobs/dcp_reader.py``): a forged
``.metadata`` is refused, not run, whatever the key. A checkpoint whose HMAC is wrong or missing is
refused (``UntrustedCheckpoint``, naming its ``meta.json``; one saved before signing was on names
``mlstm-sentiment checkpoints sign``, which signs it once its owner has checked it); a cached
consolidation without its own valid HMAC is made again from the checked files. The digests alone say
nothing against someone who can write the store: they would rewrite ``meta.json`` with their file's
digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import pickle
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.mlstm import MLSTM, MLSTMConfig
from tasks import signing
from tasks.signing import HMAC_FIELD
from tasks.store import LocalStore, Store, StoreError, open_store

log = logging.getLogger(__name__)

LATEST = "latest.json"
STATE_FILE = "state.pt"
RUN_STATE_FILE = "run_state.pt"  # a sharded checkpoint's state besides the DCP files
SHARDED_DIR = "sharded"  # a sharded checkpoint's DCP files
CONSOLIDATED = "consolidated.json"  # the sha256 of a sharded checkpoint's cached state.pt
DCP = "dcp"
DCP_METADATA = ".metadata"  # DCP's index of a sharded checkpoint's files: a pickle
_STEP_DIR = re.compile(r"step-(\d{7,})$")


class DamagedCheckpoint(ValueError):
    """A checkpoint file that does not match its recorded sha256 or cannot be read: no retry mends it."""


class UntrustedCheckpoint(DamagedCheckpoint):
    """A checkpoint whose HMAC under the key is wrong or missing: not read."""


def _check_meta(meta: dict[str, Any], url: str) -> None:
    """``meta.json`` is the pipeline's (``UntrustedCheckpoint`` if not), and it records the digest of
    every file a reader will open."""
    folder = url.removesuffix("/meta.json")
    unsigned = f": check it, then sign it with `mlstm-sentiment checkpoints sign {folder}`"
    signing.check(signing.key(), meta, url, UntrustedCheckpoint, unsigned=unsigned)
    digests = meta.get("sha256", {})
    if missing := [name for name in needed_files(meta) if name not in digests]:
        raise UntrustedCheckpoint(f"{url} records no sha256 of {', '.join(missing)}: not read")


def needed_files(meta: dict[str, Any]) -> list[str]:
    """The files of a checkpoint whose sha256 its signed ``meta.json`` must hold (a sharded one's DCP
    files besides ``.metadata`` are checked against theirs as they are read)."""
    return [f"{SHARDED_DIR}/{DCP_METADATA}", RUN_STATE_FILE] if meta.get("format") == DCP else [STATE_FILE]


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
    # A sharded checkpoint loaded to resume: its DCP files on this machine (``state`` then has no
    # model or optimizer: they load from here, into any sharding).
    sharded: Path | None = None

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


def _save_state(store: Store, key: str, state: dict[str, Any]) -> str:
    """torch.save a state into the store; the sha256 of the bytes as written here."""
    with store.writer(key) as path:
        with path.open("wb") as file:
            torch.save(state, file)
        # Of the bytes as written here: a copy or a disk that cuts the published file short shows on load.
        with path.open("rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()


def save_checkpoint(store: Store, run: str, step: int, state: dict[str, Any], meta: dict[str, Any]) -> str:
    """Write a step's checkpoint, then point ``latest.json`` at it. Returns the checkpoint's URI."""
    digest = _save_state(store, f"{step_prefix(run, step)}/{STATE_FILE}", state)
    return _publish(store, run, step, {**meta, "sha256": {STATE_FILE: digest}})


def save_shards(store: Store, run: str, step: int, directory: Path) -> dict[str, str]:
    """Copy the DCP files one rank wrote into ``directory`` into the step's ``sharded/`` folder.

    Every rank calls this for its own files; the answer (file name → sha256) goes to rank 0, whose
    ``save_sharded_checkpoint`` records them all.
    """
    digests = {}
    for path in sorted(directory.iterdir()):
        if path.is_file():
            with path.open("rb") as file:
                digests[path.name] = hashlib.file_digest(file, "sha256").hexdigest()
            store.put_file(path, f"{step_prefix(run, step)}/{SHARDED_DIR}/{path.name}")
    return digests


def save_sharded_checkpoint(
    store: Store,
    run: str,
    step: int,
    run_state: dict[str, Any],
    shards: dict[str, str],
    meta: dict[str, Any],
) -> str:
    """Rank 0, once every rank's ``save_shards`` is done: ``run_state.pt``, ``meta.json``, then
    ``latest.json``. Returns the checkpoint's URI."""
    digest = _save_state(store, f"{step_prefix(run, step)}/{RUN_STATE_FILE}", run_state)
    sha256 = {RUN_STATE_FILE: digest, **{f"{SHARDED_DIR}/{name}": d for name, d in shards.items()}}
    return _publish(store, run, step, {**meta, "format": DCP, "sha256": sha256})


def _publish(store: Store, run: str, step: int, meta: dict[str, Any]) -> str:
    """Write ``meta.json`` once the step's files are in place, then ``latest.json`` last."""
    prefix = step_prefix(run, step)
    meta = signing.signed({**meta, "step": step, "run": run})
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
    if not store.exists(key):
        return None
    try:
        return dict(json.loads(store.read_bytes(key)))
    except (ValueError, TypeError) as error:  # cut short or overwritten: name the file, not just the parser
        raise DamagedCheckpoint(f"{store.url(key)} is damaged: not a JSON object ({error})") from None


def newest_checkpoint(store: Store) -> str | None:
    """The checkpoint of the run saved last in the store (what a nightly re-evaluation reads)."""
    newest: tuple[str, str] | None = None
    for key in store.list("runs"):
        if key.endswith(f"/{LATEST}") and key.count("/") == 2:
            latest = json.loads(store.read_bytes(key))
            candidate = (latest.get("saved_at", ""), latest["checkpoint_uri"])
            newest = max(newest, candidate) if newest else candidate
    return newest[1] if newest else None


def _read_state(store: Store, key: str, expected: str | None, map_location: Any) -> dict[str, Any]:
    """A torch.save'd state from the store, checked against its sha256 (``DamagedCheckpoint`` if not)."""
    url = store.url(key)
    with store.open_read(key) as stream:
        data = stream.read()
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise DamagedCheckpoint(
            f"{url} is damaged: its {len(data):,} bytes do not match the sha256 in its meta.json"
        )
    try:
        state: dict[str, Any] = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError) as error:
        raise DamagedCheckpoint(f"{url} is damaged: it cannot be read ({error})") from error
    return state


def load_from(
    store: Store,
    prefix: str,
    *,
    map_location: str | torch.device = "cpu",
    shards_to: Path | None = None,
) -> Checkpoint:
    """The checkpoint in the folder ``prefix`` of a store ("" for the store's root).

    A sharded checkpoint: with ``shards_to`` (a resume), its DCP files checked and made local (in place
    for a folder store, else downloaded there) and ``state`` its ``run_state.pt``; without, its
    consolidated ``state.pt`` (made on first use and cached in the store).

    Raises ``DamagedCheckpoint`` when a file does not match the sha256 recorded in ``meta.json`` or
    (a checkpoint saved before digests were recorded) cannot be unpickled.
    """

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    if not store.exists(key("meta.json")):
        raise StoreError(f"{store.url(prefix)} is not a checkpoint: it has no meta.json")
    meta = json.loads(store.read_bytes(key("meta.json")))
    _check_meta(meta, store.url(key("meta.json")))  # before any other file is opened
    uri = store.url(prefix) if prefix else store.uri
    if meta.get("format") == DCP:
        if shards_to is not None:
            state = _read_state(store, key(RUN_STATE_FILE), meta["sha256"][RUN_STATE_FILE], map_location)
            return Checkpoint(
                uri, meta, state, sharded=_local_shards(store, key(SHARDED_DIR), meta, shards_to)
            )
        return Checkpoint(uri, meta, _consolidated(store, key, meta, map_location))
    if not store.exists(key(STATE_FILE)):
        raise StoreError(f"{store.url(prefix)} is not a checkpoint: it has no {STATE_FILE}")
    expected = meta.get("sha256", {}).get(STATE_FILE)
    return Checkpoint(uri, meta, _read_state(store, key(STATE_FILE), expected, map_location))


def _shard_digests(meta: dict[str, Any]) -> dict[str, str]:
    return {
        name.removeprefix(f"{SHARDED_DIR}/"): digest
        for name, digest in meta["sha256"].items()
        if name.startswith(f"{SHARDED_DIR}/")
    }


def _local_shards(store: Store, prefix: str, meta: dict[str, Any], local: Path) -> Path:
    """The DCP folder on this machine (in place in a folder store, else downloaded into ``local``),
    every file checked against its sha256."""
    directory = store.path(prefix) if isinstance(store, LocalStore) else local
    directory.mkdir(parents=True, exist_ok=True)
    for name, expected in _shard_digests(meta).items():
        url, path = f"{store.url(prefix)}/{name}", directory / name
        if not store.exists(f"{prefix}/{name}"):
            raise DamagedCheckpoint(f"{url} is missing")
        if directory == local:
            store.download(f"{prefix}/{name}", path)
        with path.open("rb") as file:
            if hashlib.file_digest(file, "sha256").hexdigest() != expected:
                raise DamagedCheckpoint(f"{url} is damaged: it does not match the sha256 in its meta.json")
    return directory


def _consolidated(store: Store, key: Any, meta: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """A sharded checkpoint as one ``state.pt``'s state: the cached file, else made now and cached."""
    secret = signing.key()
    if store.exists(key(CONSOLIDATED)) and store.exists(key(STATE_FILE)):
        cached = json.loads(store.read_bytes(key(CONSOLIDATED)))
        with contextlib.suppress(DamagedCheckpoint):  # a damaged or unsigned cache is made again
            # Signed with the checkpoint's own HMAC: not another step's cache.
            signing.check(
                secret, {**cached, "of": meta[HMAC_FIELD]}, store.url(key(CONSOLIDATED)), UntrustedCheckpoint
            )
            return _read_state(store, key(STATE_FILE), cached["sha256"], map_location)
    from tasks.jobs.sharding import consolidate

    run_state = _read_state(store, key(RUN_STATE_FILE), meta["sha256"][RUN_STATE_FILE], map_location)
    with tempfile.TemporaryDirectory(prefix="mlstm-dcp-") as scratch:
        directory = _local_shards(store, key(SHARDED_DIR), meta, Path(scratch))
        state = consolidate(directory, run_state)
    try:
        digest = _save_state(store, key(STATE_FILE), state)
        cached = {"sha256": digest}
        cached[HMAC_FIELD] = signing.signature(secret, {**cached, "of": meta[HMAC_FIELD]})
        store.write_bytes(key(CONSOLIDATED), json.dumps(cached).encode())
        log.info("consolidated %s into %s", store.url(key(SHARDED_DIR)), store.url(key(STATE_FILE)))
    except (OSError, StoreError) as error:  # a store this reader cannot write: consolidate each time
        log.warning("cannot cache the consolidated %s: %s", store.url(key(STATE_FILE)), error)
    return state


def run_steps(store: Store, run: str) -> list[int]:
    """The steps of a run that have a checkpoint folder, newest first."""
    steps = set()
    for key in store.list(f"{run_prefix(run)}/checkpoints"):
        match = _STEP_DIR.search(key.rpartition("/")[0])
        if match and key.endswith((f"/{STATE_FILE}", f"/{RUN_STATE_FILE}")):
            steps.add(int(match.group(1)))
    return sorted(steps, reverse=True)


def load_intact(
    store: Store, run: str, *, map_location: str | torch.device = "cpu", shards_to: Path | None = None
) -> tuple[Checkpoint, list[str]] | None:
    """The run's newest intact checkpoint (from ``latest.json``'s step down) and the damaged files
    skipped on the way; None for a run without ``latest.json``. No intact one: ``DamagedCheckpoint``
    naming every damaged file. ``shards_to``: as in ``load_from`` (a sharded step stays sharded)."""
    saved = run_steps(store, run)  # newest first
    try:
        latest = read_latest(store, run)
    except DamagedCheckpoint as error:  # the steps' own folders still say what was saved
        damaged, candidates = [str(error)], saved
    else:
        if latest is None:
            return None
        newest = int(latest["step"])
        damaged, candidates = [], [newest, *(s for s in saved if s < newest)]
    for step in candidates:
        try:
            found = load_from(store, step_prefix(run, step), map_location=map_location, shards_to=shards_to)
            return found, damaged
        except (DamagedCheckpoint, StoreError) as error:  # a file gone counts as damage here
            damaged.append(str(error))
    raise DamagedCheckpoint(
        f"run {run} has no intact checkpoint to resume from: "
        + "; ".join(damaged)
        + " (choose a new --run, or restore the files)"
    )


def read_meta(uri: str, **store_options: Any) -> tuple[str, dict[str, Any]]:
    """A checkpoint's URI and its ``meta.json`` (HMAC checked), without loading its tensors: a step
    folder, or a run folder or its ``latest.json`` (then the step ``latest.json`` names)."""
    uri = uri.rstrip("/").removesuffix(f"/{LATEST}")
    store = open_store(uri, **store_options)
    if not _STEP_DIR.search(uri):
        if not store.exists(LATEST):
            raise StoreError(
                f"{uri} is neither a checkpoint folder (…/checkpoints/step-NNNNNNN) nor a run with a {LATEST}"
            )
        latest = json.loads(store.read_bytes(LATEST))
        uri, store = (
            store.url(latest["checkpoint"]),
            open_store(store.url(latest["checkpoint"]), **store_options),
        )
    if not store.exists("meta.json"):
        raise StoreError(f"{uri} is not a checkpoint: it has no meta.json")
    meta: dict[str, Any] = json.loads(store.read_bytes("meta.json"))
    _check_meta(meta, store.url("meta.json"))
    return uri, meta


def checkpoint_digest(meta: dict[str, Any]) -> str:
    """A checkpoint's identity by content: the sha256 of the file digests its ``meta.json`` records
    (weights and Adam's state, whole or as DCP shares), read without loading a tensor."""
    if not meta.get("sha256"):
        raise DamagedCheckpoint(
            f"checkpoint {meta.get('run')} step {meta.get('step')} records no sha256 of its files (saved "
            "before they were): continue from a newer checkpoint"
        )
    return hashlib.sha256(json.dumps(meta["sha256"], sort_keys=True).encode()).hexdigest()


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


def sign_step(store: Store, prefix: str) -> str:
    """Sign the checkpoint in ``prefix`` ("" for the store's root) as it is now, for its owner who has
    checked it (one saved before signing was on, or under another key): ``meta.json`` gets the sha256
    of every file a reader opens (a digest it records must still match: a damaged file is not signed)
    and the key's HMAC. Returns the checkpoint's URI."""

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    if not store.exists(key("meta.json")):
        raise StoreError(f"{store.url(prefix)} is not a checkpoint: it has no meta.json")
    meta = {k: v for k, v in json.loads(store.read_bytes(key("meta.json"))).items() if k != HMAC_FIELD}
    digests = dict(meta.get("sha256", {}))
    names = needed_files(meta)
    if meta.get("format") == DCP:  # every rank's DCP files too
        names += [name for name in digests if name.startswith(f"{SHARDED_DIR}/") and name not in names]
    for name in names:
        url = store.url(key(name))
        if not store.exists(key(name)):
            raise DamagedCheckpoint(f"{url} is missing: not signed")
        digest = hashlib.sha256()
        with store.open_read(key(name)) as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
        if digests.setdefault(name, digest.hexdigest()) != digest.hexdigest():
            raise DamagedCheckpoint(
                f"{url} is damaged: it does not match the sha256 in its meta.json; not signed"
            )
    signed = signing.signed({**meta, "sha256": digests})
    store.write_bytes(key("meta.json"), json.dumps(signed, indent=2).encode())
    return store.url(prefix) if prefix else store.uri


def sign_checkpoints(target: str, store_uri: str, **store_options: Any) -> list[str]:
    """``mlstm-sentiment checkpoints sign``: a checkpoint folder (…/checkpoints/step-NNNNNNN), a run
    folder (every step of it), or a run's name in the store at ``store_uri``. Returns what it signed."""
    target = target.rstrip("/").removesuffix(f"/{LATEST}")
    if _STEP_DIR.search(target):
        return [sign_step(open_store(target, **store_options), "")]
    if "/" in target or "://" in target:  # a run folder: its parent is the store's runs/
        store, run = open_store(target.rsplit("/", 2)[0], **store_options), target.rsplit("/", 1)[1]
    else:
        store, run = open_store(store_uri, **store_options), target
    steps = run_steps(store, run)
    if not steps:
        raise StoreError(
            f"{store.url(run_prefix(run))} has no checkpoint to sign: pass a run's name, its folder, or a "
            "checkpoint folder (…/checkpoints/step-NNNNNNN)"
        )
    return [sign_step(store, step_prefix(run, step)) for step in steps]
