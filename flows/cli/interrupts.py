"""Ctrl-C and SIGTERM during a long command: one line and the shell's exit code, nothing left running.

Ctrl-C raises ``KeyboardInterrupt`` in this process (Python's own handler); SIGTERM is made to raise too,
so that both unwind the same way: the job is cancelled (its ranks checkpoint, ``flows.jobs``), the
flow runs end Crashed, the temporary Prefect API stops (``flows.runtime.prefect_api``), and only then is
the line printed. Click would print "Aborted!" and exit 1 for an interrupt that reached it, so the
interrupt is caught here, inside the command.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.text import Text

# The shell's convention: 128 + the signal's number.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


# stderr, as flows.cli.common's: that module starts a command's flows within ``stoppable``.
err = Console(stderr=True, soft_wrap=True, markup=False)


class Terminated(BaseException):
    """SIGTERM outside a flow run (inside one, Prefect raises its own ``TerminationSignal``)."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _is_termination(error: BaseException) -> bool:
    return isinstance(error, Terminated) or type(error).__name__ == "TerminationSignal"


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """The block stops on Ctrl-C or SIGTERM with one line (what was checkpointed, and that a rerun of the
    same command resumes) and exit code 130 or 143, instead of a traceback."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    except KeyboardInterrupt as error:
        raise _stopped(error, "interrupted", EXIT_INTERRUPTED) from None
    except BaseException as error:
        if not _is_termination(error):
            raise
        raise _stopped(error, "terminated", EXIT_TERMINATED) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped(error: BaseException, what: str, code: int) -> typer.Exit:
    # What the stopped jobs said (``flows.jobs.launch_and_watch`` notes it on the exception): a
    # termination re-raised by Prefect's teardown carries the first one as its context.
    notes: list[str] = []
    seen: BaseException | None = error
    while seen is not None:
        notes = [*getattr(seen, "__notes__", []), *notes]
        seen = seen.__context__
    done = "; ".join(dict.fromkeys(notes)) or "nothing is left running"
    err.print(
        Text.assemble((f"{what}:", "bold yellow"), f" {done}; run the same command again to resume"),
        highlight=False,
    )
    return typer.Exit(code=code)
