"""HMAC-SHA256 signatures under ``MLSTM_CHECKPOINT_KEY``: what makes a checkpoint, or a registered
classifier's files, the pipeline's own and not whatever someone with write access to the store or the
MLflow artifact root left there. A signed object is a JSON object holding the sha256 of every file it
speaks for, plus ``hmac_sha256`` over its canonical form; without the key nothing is signed or checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

HMAC_FIELD = "hmac_sha256"


class Untrusted(ValueError):
    """An object whose HMAC is wrong or missing while the key is set: not read."""


def key() -> bytes | None:
    """The key's bytes, or None where no key is set."""
    from tasks.settings import get_settings

    secret = get_settings().checkpoint_key
    return secret.get_secret_value().encode() if secret else None


def signature(secret: bytes, signed: dict[str, Any]) -> str:
    """The HMAC-SHA256 of a JSON object's canonical form, its own HMAC field left out."""
    body = {name: value for name, value in signed.items() if name != HMAC_FIELD}
    message = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def signed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its HMAC under the key; as it is without the key."""
    secret = key()
    return {**body, HMAC_FIELD: signature(secret, body)} if secret else body


def check(secret: bytes, body: dict[str, Any], url: str, error: type[ValueError] = Untrusted) -> None:
    """Raise ``error`` naming ``url`` unless ``body`` carries its HMAC under ``secret``."""
    found = body.get(HMAC_FIELD)
    if not isinstance(found, str):
        raise error(
            f"{url} has no HMAC and MLSTM_CHECKPOINT_KEY is set: not read (saved without the key, or "
            "not by the pipeline)"
        )
    if not hmac.compare_digest(found, signature(secret, body)):
        raise error(
            f"{url} does not match its HMAC under MLSTM_CHECKPOINT_KEY: not read (changed since it "
            "was saved, or saved with another key)"
        )
