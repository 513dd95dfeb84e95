"""One build of a corpus at a time in a store: a lock object beside the manifest it will publish.

Two builds of the same sources into one store would share the work files under ``_work/`` and delete
them under each other. The first claims ``corpora/<id>/_lock.json`` with a write that succeeds only where
nothing is (a folder's exclusive create, S3's ``If-None-Match: *``); the second is told who builds it.
A lock whose build was killed is taken over: its process is gone (same host), or it has not been
refreshed for ``STALE_SECONDS`` (a build refreshes it as each piece and bucket is done).

A delta (``corpus build --base``) also holds ``corpora/<base id>/_delta_lock.json``: two deltas on one
base at once, the second is told which build grows it; it runs again once that one is done, on
``--base newest`` to grow what it published.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from tasks.store import Store

STALE_SECONDS = 15 * 60  # far above the time one piece or bucket takes


class BuildInProgress(ValueError):
    """Another build of this corpus holds the lock; the message says which and where."""


class BuildLock:
    def __init__(
        self,
        store: Store,
        key: str,
        *,
        doing: str = "built",
        advice: str = "run again when it has finished",
        also: BuildLock | None = None,
    ) -> None:
        self.store, self.key = store, key
        self.doing, self.advice = doing, advice
        self.also = also  # another lock this build holds, refreshed and released with this one
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}

    def claim(self, corpus_id: str) -> None:
        """Hold the lock, taking over a dead build's; ``BuildInProgress`` if a live build holds it."""
        if self.store.create(self.key, self._record()):
            return
        held = self._held()
        if held is not None and not _stale(held):
            started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(held.get("started_at", 0)))
            raise BuildInProgress(
                f"corpus {corpus_id} is being {self.doing} by process {held.get('pid')} on {held.get('host')} "
                f"since {started} ({self.store.url(self.key)}): {self.advice}; if that build is gone, delete "
                "that file"
            )
        self.store.delete_prefix(self.key)  # a killed build's: its work files are resumed, not lost
        if not self.store.create(self.key, self._record()):
            raise BuildInProgress(
                f"corpus {corpus_id}: another build took over {self.store.url(self.key)} just now"
            )

    def refresh(self) -> None:
        """This build is alive: called as its pieces and buckets finish."""
        self.store.write_bytes(self.key, self._record())
        if self.also is not None:
            self.also.refresh()

    def release(self) -> None:
        # A store gone as the build failed keeps the lock: stale, and taken over, once this process ends.
        with contextlib.suppress(Exception):
            self.store.delete_prefix(self.key)
        if self.also is not None:
            self.also.release()

    def _record(self) -> bytes:
        return json.dumps({**self.owner, "refreshed_at": time.time()}).encode()

    def _held(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.store.read_bytes(self.key)))
        except (OSError, ValueError, TypeError):
            return None  # gone since, or unreadable: not a live build's


def _stale(held: dict[str, Any]) -> bool:
    if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
    return time.time() - float(held.get("refreshed_at", 0)) > STALE_SECONDS


@contextlib.contextmanager
def building(store: Store, prefix: str, corpus_id: str, *, grows: str | None = None) -> Iterator[BuildLock]:
    """The lock on the corpus at ``prefix`` for the length of the block; released however it ends.
    A delta on the corpus at ``grows`` (its folder) holds that corpus's delta lock too, first."""
    base = None
    if grows is not None:
        base = BuildLock(
            store,
            f"{grows}/_delta_lock.json",
            doing="grown by a delta",
            advice="one delta at a time on a corpus: run again when it has finished, with --base newest "
            "to grow what it built",
        )
        base.claim(grows.rpartition("/")[2])
    lock = BuildLock(store, f"{prefix}/_lock.json", also=base)
    try:
        lock.claim(corpus_id)
    except BaseException:
        if base is not None:
            base.release()
        raise
    try:
        yield lock
    finally:
        lock.release()
