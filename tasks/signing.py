"""HMAC-SHA256 signatures: what makes a checkpoint, or a registered classifier's files, the pipeline's
own and not whatever someone with write access to the store or the MLflow artifact root left there. A
signed object is a JSON object holding the sha256 of every file it speaks for, plus ``hmac_sha256``
over its canonical form.

Signing is always on. The key is ``MLSTM_CHECKPOINT_KEY`` where it is set (a team's shared key, from
its secret store), else a random key made on first use in ``$MLSTM_HOME/keys/checkpoint.key`` (mode
0600): every process of one home, and every job it launches on this machine or a Slurm cluster's shared
disk, signs and checks with the same key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

HMAC_FIELD = "hmac_sha256"
KEY_VARIABLE = "MLSTM_CHECKPOINT_KEY"
KEY_FILE = Path("keys") / "checkpoint.key"  # under MLSTM_HOME


class Untrusted(ValueError):
    """An object whose HMAC is wrong or missing: not read."""


class NoKey(ValueError):
    """The key file cannot be made or read: nothing can be signed or checked."""


def key_file(home: Path) -> Path:
    return home.resolve() / KEY_FILE


def key_name() -> str:
    """Where the key in force comes from, as an error line names it."""
    from tasks.settings import get_settings

    settings = get_settings()
    if settings.checkpoint_key is not None:
        return KEY_VARIABLE
    return f"the key in {key_file(settings.home)} ({KEY_VARIABLE} unset)"


def key() -> bytes:
    """The key's bytes: ``MLSTM_CHECKPOINT_KEY``, else this home's key file (made on first use)."""
    from tasks.settings import get_settings

    settings = get_settings()
    if settings.checkpoint_key is not None:
        return settings.checkpoint_key.get_secret_value().encode()
    return home_key(settings.home)


def home_key(home: Path) -> bytes:
    """The key in ``home``'s key file, made now if there is none. Two processes racing here end with
    one key: each writes a whole file of its own, and only the first hard link to the key's name wins."""
    path = key_file(home)
    if not path.exists():
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            scratch = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
            descriptor = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(descriptor, "w") as file:
                    file.write(secrets.token_hex(32) + "\n")
                    file.flush()
                    os.fsync(file.fileno())
                with contextlib.suppress(FileExistsError):  # another process made it first: theirs
                    os.link(scratch, path)
            finally:
                scratch.unlink(missing_ok=True)
        except OSError as error:
            raise NoKey(
                f"cannot make the checkpoint key {path} under MLSTM_HOME ({error.strerror or error}): "
                f"give a writable MLSTM_HOME, or set {KEY_VARIABLE}"
            ) from None
    try:
        secret = path.read_text().strip()
    except OSError as error:
        raise NoKey(f"cannot read the checkpoint key {path} ({error.strerror or error})") from None
    if not secret:
        raise NoKey(f"the checkpoint key {path} is empty: restore it, or set {KEY_VARIABLE}")
    return secret.encode()


def signature(secret: bytes, signed: dict[str, Any]) -> str:
    """The HMAC-SHA256 of a JSON object's canonical form, its own HMAC field left out."""
    body = {name: value for name, value in signed.items() if name != HMAC_FIELD}
    message = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def signed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its HMAC under the key."""
    return {**body, HMAC_FIELD: signature(key(), body)}


def check(
    secret: bytes, body: dict[str, Any], url: str, error: type[ValueError] = Untrusted, unsigned: str = ""
) -> None:
    """Raise ``error`` naming ``url`` unless ``body`` carries its HMAC under ``secret``; ``unsigned``
    ends the line for an object with no HMAC at all (what to do about it)."""
    found = body.get(HMAC_FIELD)
    if not isinstance(found, str):
        raise error(
            f"{url} is not signed: not read (saved before signing was on by default, or not by the "
            f"pipeline){unsigned}"
        )
    if not hmac.compare_digest(found, signature(secret, body)):
        raise error(
            f"{url} does not match its HMAC under {key_name()}: not read (changed since it was saved, "
            f"or saved with another key: set {KEY_VARIABLE} to the key it was saved with)"
        )
