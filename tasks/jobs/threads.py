"""How many torch threads a process takes: its share of the cores it may use, and one for a small model.

Left alone, every torch process takes a thread per core, so processes that share the cores (a job's
ranks on one node, a scoring run's workers, the test suite's workers) spin against each other: each
product waits for a thread that another process has descheduled. A small model's products gain little
from a second thread and lose most to a busy core: on two cores the tiny (64 units) and small (1,024)
presets train somewhat faster on two threads when nothing else runs, and several times faster on one
when another process keeps a core busy, as the suite's workers, a job's ranks and a scoring run's
workers do (``benchmarks/threads.py``, its figures in docs/benchmarks.md). So a small model takes one
thread. An explicit ``OMP_NUM_THREADS`` (or a caller's own count) always wins: a lone run on an idle
machine may set 2.

The rule is ``thread_share``, a pure function; ``take_share`` applies it to this process. Importing
this module imports no torch, so a caller may size the threads before torch is first imported.
"""

from __future__ import annotations

import os

# Widths up to this take one thread: the presets at and below it (tiny 64, small 1,024) lose little on
# one thread when the cores are free and gain several-fold when one is busy (benchmarks/threads.py);
# wider ones are not measured on a CPU.
SMALL_WIDTH = 1024


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a Slurm allocation or a container narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def explicit_threads() -> int | None:
    """``OMP_NUM_THREADS`` where it is set to a positive whole number, else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def thread_share(
    *, cores: int, sharers: int = 1, width: int | None = None, explicit: int | None = None
) -> int:
    """The torch threads of one of ``sharers`` processes on ``cores`` cores, for a model ``width`` units
    wide (None: not known): ``explicit`` where given; one for a small model; else an equal share of the
    cores, at least one."""
    if explicit is not None:
        if explicit < 1:
            raise ValueError(f"threads must be at least 1, got {explicit}")
        return explicit
    if sharers < 1:
        raise ValueError(f"sharers must be at least 1, got {sharers}")
    if width is not None and width <= SMALL_WIDTH:
        return 1
    return max(1, cores // sharers)


def take_share(*, sharers: int = 1, width: int | None = None, explicit: int | None = None) -> int:
    """Set this process's torch threads to ``thread_share`` of its usable cores (``explicit``, else an
    ``OMP_NUM_THREADS`` set by hand, wins) and return the count."""
    import torch

    threads = thread_share(
        cores=usable_cores(),
        sharers=sharers,
        width=width,
        explicit=explicit if explicit is not None else explicit_threads(),
    )
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
