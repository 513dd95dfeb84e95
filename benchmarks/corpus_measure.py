"""How a row of the corpus benchmarks (``corpus.py``, ``corpus_delta.py``) is measured: timed, with the
peak RSS and CPU time of the process tree sampled from /proc, in a fresh run folder isolated from
earlier runs.

The harness both benchmarks share, kept apart from the runs they measure and the reports they print.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import say  # the working tree on the path

# ---------------------------------------------------------------------------------------------
# Peak RSS and CPU time of the process tree


@dataclass
class Peaks:
    """Highest values seen, in bytes. RSS counts the file pages a process has mapped (memory-mapped
    files, shared libraries) as well as its own memory; ``tree_anon`` counts only its own."""

    tree: int = 0  # summed RSS of the process and all its descendants
    tree_anon: int = 0  # the same without file-backed and shared pages
    process: int = 0  # the largest single process
    tree_without_api: int = 0  # the tree without the Prefect API server
    api: int = 0  # the Prefect API server alone

    def merge(self, other: Peaks) -> None:
        for name in ("tree", "tree_anon", "process", "tree_without_api", "api"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))


class TreeSampler:
    """Samples the summed RSS and the CPU time of a process and all of its descendants from /proc.

    CPU time is counted per process from its first to its last sample, so a worker that exits
    between two samples loses at most one interval of it; os.times() would miss workers that
    have not been waited for yet (Prefect's pool) and the API server entirely.
    """

    def __init__(self, root: int, interval: float = 0.1) -> None:
        self.root = root
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.tick = os.sysconf("SC_CLK_TCK")
        self.peaks = Peaks()
        self.series: list[tuple[float, int]] = []  # (wall time, summed RSS of the tree)
        self._api: dict[int, bool] = {}
        self._cpu_first: dict[int, int] = {}
        self._cpu_last: dict[int, int] = {}
        self._started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self.sample()
        self._started = True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def cpu_seconds(self) -> float:
        return sum(self.cpu_seconds_by_role().values())

    def cpu_seconds_by_role(self) -> dict[str, float]:
        """CPU seconds of this process, of the Prefect API server and of the other descendants."""
        roles = {"this process": 0.0, "API server": 0.0, "workers": 0.0}
        for pid, last in self._cpu_last.items():
            role = "this process" if pid == self.root else "API server" if self._api.get(pid) else "workers"
            roles[role] += (last - self._cpu_first[pid]) / self.tick
        return roles

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def _tree(self) -> dict[int, int]:
        """CPU ticks (user + system) of the root and each of its descendants, by pid."""
        children: dict[int, list[int]] = {}
        ticks: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stream:
                    stat = stream.read()
            except OSError:
                continue  # exited meanwhile
            # The command name may hold spaces and parentheses; the fields after it do not
            # (they start at field 3, state: ppid is field 4, utime 14, stime 15).
            fields = stat.rpartition(b")")[2].split()
            pid = int(entry.name)
            children.setdefault(int(fields[1]), []).append(pid)
            ticks[pid] = int(fields[11]) + int(fields[12])
        tree: dict[int, int] = {}
        todo = [self.root]
        while todo:
            pid = todo.pop()
            tree[pid] = ticks.get(pid, 0)
            todo.extend(children.get(pid, ()))
        return tree

    def _is_api(self, pid: int) -> bool:
        if pid not in self._api:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as stream:
                    self._api[pid] = b"uvicorn" in stream.read()
            except OSError:
                return False
        return self._api[pid]

    def sample(self) -> None:
        total = anon = api = 0
        peaks = self.peaks
        for pid, ticks in self._tree().items():
            # A process first seen after the start began within the window: all its time counts.
            self._cpu_first.setdefault(pid, ticks if not self._started else 0)
            self._cpu_last[pid] = ticks
            try:
                with open(f"/proc/{pid}/statm", "rb") as stream:
                    # In pages: size, resident, shared (file-backed or shared memory), …
                    _, resident, shared = (int(v) for v in stream.read().split()[:3])
            except (OSError, ValueError):
                continue
            total += resident * self.page
            anon += (resident - shared) * self.page
            peaks.process = max(peaks.process, resident * self.page)
            if self._is_api(pid):
                api += resident * self.page
        peaks.tree = max(peaks.tree, total)
        peaks.tree_anon = max(peaks.tree_anon, anon)
        peaks.tree_without_api = max(peaks.tree_without_api, total - api)
        peaks.api = max(peaks.api, api)
        self.series.append((time.time(), total))


# ---------------------------------------------------------------------------------------------
# Measurements


@dataclass
class Row:
    name: str
    seconds: float
    cpu_seconds: float
    peaks: Peaks
    notes: str = ""
    mb_per_s: float | None = None
    ratio_vs_floor: float | None = None
    runs: list[float] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def measure(
    name: str,
    run: Callable[[int], dict[str, Any]],
    repeat: int,
    *,
    notes: str,
    after: Callable[[int, dict[str, Any]], None] | None = None,
) -> Row:
    """Time ``run(attempt)`` ``repeat`` times; keep the fastest time and the highest peaks.

    ``after(attempt, details)`` runs untimed after each attempt (checks, deleting outputs). When
    the details name stage ``windows`` (seconds after the call), the peak RSS of each is added.
    """
    import gc

    import pyarrow as pa

    row: Row | None = None
    for attempt in range(repeat):
        say(f"{name} (run {attempt + 1}/{repeat}) …")
        # Start each run from a quiet machine: what earlier rows left dirty is written back, and
        # memory they freed is handed back, so no row pays for another's work.
        gc.collect()
        pa.default_memory_pool().release_unused()
        os.sync()
        with TreeSampler(os.getpid()) as sampler:
            called = time.time()
            started = time.perf_counter()
            details = run(attempt)
            seconds = time.perf_counter() - started
        say(f"  {seconds:.2f} s, peak RSS {gib(sampler.peaks.tree)}")
        details["rss_tree_at_start"] = sampler.series[0][1]
        details["cpu_seconds_by_role"] = sampler.cpu_seconds_by_role()
        if after is not None:
            after(attempt, details)
        if "windows" in details:
            details["peak_rss_tree_by_stage"] = {
                # Widened by one sampling interval, so a stage shorter than that still has a sample.
                stage: max(
                    (rss for t, rss in sampler.series if begin - 0.1 <= t - called <= end + 0.1), default=0
                )
                for stage, (begin, end) in details["windows"].items()
            }
        if row is None or seconds < row.seconds:
            runs = [] if row is None else row.runs
            peaks = Peaks() if row is None else row.peaks
            row = Row(name, seconds, sampler.cpu_seconds, peaks, notes=notes, runs=runs, details=details)
        row.peaks.merge(sampler.peaks)
        row.runs.append(round(seconds, 3))
    assert row is not None
    return row


def gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


# ---------------------------------------------------------------------------------------------
# The run folder


def _isolate(run_dir: Path) -> None:
    """A fresh home for everything that could remember an earlier run, and quiet consoles.

    Set before prefect or mlflow is imported: both read their settings at import.
    """
    os.environ["MLSTM_HOME"] = str(run_dir / "home-0")
    os.environ["MLSTM_MLFLOW_TRACKING_URI"] = f"sqlite:///{run_dir / 'mlflow.db'}"
    os.environ["PREFECT_HOME"] = str(run_dir / "prefect-home")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "WARNING"
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ["MLFLOW_LOGGING_LEVEL"] = "WARNING"
    for name in ("PREFECT_API_URL", "MLSTM_PREFECT_API_URL", "MLSTM_STORE_URI", "MLSTM_TASK_RUNNER"):
        os.environ.pop(name, None)


def in_workdir(args: Any, benchmark: Callable[[Any, Path, Path], int], *, prefix: str) -> int:
    """``benchmark(args, workdir, run_dir)`` with its input kept in ``args.workdir`` (a temporary folder
    when not given, removed after) and a fresh, isolated run folder inside it, removed after."""
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix=prefix))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    _isolate(run_dir)
    try:
        return benchmark(args, workdir, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
