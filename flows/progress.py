"""Progress of a running flow, for whoever is watching: the CLI's progress bar, or nobody.

A flow reports as its task futures complete (in the flow's own process, whatever the task runner),
so the CLI shows real progress without the flow knowing about terminals.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class ProgressSink(Protocol):
    def stage(self, description: str, total: float) -> None: ...

    def advance(self, amount: float = 1) -> None: ...

    def note(self, message: str) -> None:
        """An event the watcher should see as it happens (a job resumed, relaunched, stopped)."""


class _Silent:
    def stage(self, description: str, total: float) -> None:
        pass

    def advance(self, amount: float = 1) -> None:
        pass

    def note(self, message: str) -> None:
        pass


_current: ProgressSink = _Silent()


def current() -> ProgressSink:
    return _current


@contextlib.contextmanager
def reporting_to(sink: ProgressSink) -> Iterator[ProgressSink]:
    global _current
    previous, _current = _current, sink
    try:
        yield sink
    finally:
        _current = previous
