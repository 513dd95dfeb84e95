"""Credentials in URIs stay out of everything the project writes, and still reach the fetch that needs them.

A source like ``https://alice:PASSWORD@host/reviews.json.gz?token=…`` or a presigned S3 URL carries its
secret in the URI itself. Whatever is stored or shown (manifests, rejected files, MLflow parameters and
tags, Prefect parameters, names, logs and artifacts, the terminal) holds its ``redact``-ed form instead:
user-info and secret query values become ``***``. ``hide`` is the boundary where a source enters: it
returns the redacted form and remembers the real one for this process and the processes it starts (a
worker pool inherits the environment), where ``reveal`` gives it back to the code that fetches.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# Query keys whose values are credentials: signed URLs (S3, GCS, Azure SAS) and the usual token names.
SECRET_QUERY_KEYS = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "signature",
        "sig",
        "token",
        "access_token",
        "id_token",
        "auth",
        "authorization",
        "key",
        "api_key",
        "apikey",
        "password",
        "passwd",
        "secret",
        "client_secret",
    }
)
# A URI inside free text (an error message, a log line): a scheme, then anything up to a space or quote.
_URI_IN_TEXT = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>`]+")
# Where ``hide`` keeps the real URIs, for this process and its children.
ENVIRONMENT = "MLSTM_SOURCE_SECRETS"


def redact(uri: str) -> str:
    """``uri`` without its credentials: user-info and secret query values replaced by ``***``. A path or
    a URI without credentials comes back unchanged, so redacting twice is redacting once."""
    parts = urlsplit(uri)
    if not parts.scheme or not parts.netloc:
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key.lower() in SECRET_QUERY_KEYS for key, _ in pairs):
            query = urlencode(
                [(key, MASK if key.lower() in SECRET_QUERY_KEYS else value) for key, value in pairs], safe="*"
            )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def redact_text(text: str) -> str:
    """Every URI in ``text`` redacted: for messages and log lines that quote one."""

    def one(found: re.Match[str]) -> str:
        uri = found.group().rstrip(".,;:)]")  # the sentence's punctuation, not the URI's
        return redact(uri) + found.group()[len(uri) :]

    return _URI_IN_TEXT.sub(one, text)


def scrub(text: str, uri: str) -> str:
    """``text`` (a library's error message, say) with the real form of the hidden ``uri`` replaced by the
    redacted one, also where only its path and query are quoted."""
    real = reveal(uri)
    if real == uri:
        return redact_text(text)
    shown, real_parts = urlsplit(uri), urlsplit(real)
    text = text.replace(real, uri)
    if real_parts.query:
        text = text.replace(real_parts.query, shown.query)
    return redact_text(text)


def hide(uri: str) -> str:
    """The redacted form of ``uri``, to pass on, store and show; ``reveal`` gives the real one back."""
    shown = redact(uri)
    if shown == uri:
        return uri
    known = _known()
    if known.get(shown, uri) != uri:
        raise ValueError(f"two sources differ only in their credentials ({shown}): give each once")
    known[shown] = uri
    os.environ[ENVIRONMENT] = json.dumps(known)
    return shown


def reveal(uri: str) -> str:
    """The real URI that ``hide`` gave ``uri`` for, or ``uri`` itself."""
    return _known().get(uri, uri)


def _known() -> dict[str, str]:
    return json.loads(os.environ.get(ENVIRONMENT) or "{}")
