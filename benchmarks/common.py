"""What every benchmark shares: the working tree on the path, the machine's description, progress lines
and the argument parser's frame.

A benchmark imports this first (``from common import …`` works since Python puts the script's folder on
the path), so that it measures the checkout it sits in, not whatever copy the venv has installed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def say(message: str) -> None:
    """A progress line on stderr (stdout is kept for --json)."""
    print(message, file=sys.stderr, flush=True)


def fastest_of(name: str, case: Callable[[], object], repeat: int) -> dict[str, Any]:
    """``case`` run ``repeat`` times: the fastest run's seconds, each run's beside it (a fixed cost's row)."""
    runs = []
    for attempt in range(repeat):
        say(f"{name} (run {attempt + 1}/{repeat}) …")
        started = time.perf_counter()
        case()
        runs.append(round(time.perf_counter() - started, 2))
    return {"name": name, "seconds": min(runs), "runs": runs}


def new_parser(description: str, *, raw: bool = False) -> argparse.ArgumentParser:
    """The argument parser of a benchmark; ``raw`` keeps the description's lines (a module docstring)."""
    formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
    return argparse.ArgumentParser(description=description, formatter_class=formatter)


def synchronize(device: Any) -> None:
    """Waits for the work queued on ``device`` (a torch.device): a CUDA device runs it after the call
    that queued it returns, so a clock read around GPU work waits for it first; a CPU's is done."""
    if device.type == "cuda":
        import torch  # here: importing this module loads no torch (see ``machine``)

        torch.cuda.synchronize(device)


def machine(device: Any = None, **versions: str) -> dict[str, Any]:
    """What the numbers ran on: the CPU, cores this process may use, memory, Python, the platform, torch
    and the GPU when ``device`` is a CUDA one; ``versions`` adds the libraries a benchmark measures."""
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as stream:
        model = next((ln.partition(":")[2].strip() for ln in stream if ln.startswith("model name")), model)
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as stream:
        mem_kib = int(stream.readline().split()[1])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    info: dict[str, Any] = {
        "cpu": model,
        "cores": cores,
        "ram_gib": round(mem_kib / 2**20, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **versions,
    }
    if device is not None:
        import torch

        info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "device": str(device)}
        if device.type == "cuda":
            properties = torch.cuda.get_device_properties(device)
            info |= {
                "gpu": torch.cuda.get_device_name(device),
                "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
                "cuda": torch.version.cuda,
                "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            }
    return info


def checkout_path() -> str:
    """PYTHONPATH for a process a benchmark starts, so that it too runs this checkout, not an installed copy."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def profile_table(profiler: Any, device: Any, rows: int = 30) -> str:
    """A torch.profiler run's operators by self time on the device (CPU time on a CPU)."""
    averages = profiler.key_averages()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        return str(averages.table(sort_by=sort, row_limit=rows))
    except (AttributeError, KeyError, ValueError):  # older torch names device time cuda time
        return str(averages.table(sort_by=sort.replace("device", "cuda"), row_limit=rows))


def describe(info: dict[str, Any]) -> str:
    """The machine in one line, for a table's title."""
    where = info.get("gpu") or f"{info['cores']} × {info['cpu']}"
    return f"{where}, {info['ram_gib']} GiB, Python {info['python']}"


def add_record_option(parser: argparse.ArgumentParser) -> None:
    """``--record [VARIANT]``: keep this run's figures as ``benchmarks/results/NAME[-VARIANT].json``."""
    parser.add_argument(
        "--record",
        nargs="?",
        const="",
        metavar="VARIANT",
        help=(
            "Write the results to benchmarks/results/NAME.json, or NAME-VARIANT.json (e.g. cpu, gpu), "
            "from which benchmarks/render.py renders docs/benchmarks.md."
        ),
    )


def git_commit() -> str:
    """The checkout's commit, with ``-dirty`` when tracked files other than docs/ and the results differ
    from it (the figures then measured code no commit holds). MLSTM_BENCH_COMMIT, where set, says it
    instead: a copy of the tree run elsewhere (a lent GPU machine) may carry a stale .git, or none."""
    if os.environ.get("MLSTM_BENCH_COMMIT"):
        return os.environ["MLSTM_BENCH_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            # The page and the result files change as runs are recorded; they are not measured code.
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!docs",
                ":!benchmarks/results",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def record(
    name: str,
    variant: str | None,
    results: dict[str, Any],
    *,
    argv: list[str] | None = None,
    script: str | None = None,
) -> Path | None:
    """Write one run's results beside the machine, command line, commit and date it ran with.

    Does nothing when ``variant`` is None (no ``--record``). ``results`` is the benchmark's own report;
    its ``machine`` entry, when there is one, moves to the top level. ``script`` names the file that was
    run when it is not ``benchmarks/NAME.py``."""
    if variant is None:
        return None
    results = dict(results)
    info = results.pop("machine", None) or machine()
    arguments = sys.argv[1:] if argv is None else argv
    document = {
        "benchmark": name,
        "variant": variant or None,
        "command": shlex.join(["python", f"benchmarks/{script or name}.py", *arguments]),
        "commit": git_commit(),
        # What the figures measured, as content: the page tells a record's staleness without its commit.
        **({"measured": found} if (found := measured_objects(name, _revision())) else {}),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": info,
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / (f"{name}-{variant}.json" if variant else f"{name}.json")
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    say(f"results written to {path}")
    return path


@contextlib.contextmanager
def peak_rss() -> Iterator[dict[str, Any]]:
    """The largest sum of resident memory of this process and its descendants seen while the block ran
    (``peak``), what it was when the block began (``start``), and each process's own peak (``each``:
    pid → bytes; this process's is also ``own``), sampled every 0.1 s."""
    import psutil

    seen: dict[str, Any] = {"peak": 0, "start": 0, "own": 0, "each": {}}
    stop = threading.Event()

    def sample() -> None:
        me = psutil.Process()
        while not stop.is_set():
            total = 0
            for process in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss = process.memory_info().rss
                    total += rss
                    seen["each"][process.pid] = max(seen["each"].get(process.pid, 0), rss)
            seen["peak"] = max(seen["peak"], total)
            seen["own"] = seen["each"].get(me.pid, 0)
            stop.wait(0.1)

    seen["start"] = psutil.Process().memory_info().rss
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def _revision() -> str:
    """The revision the run measured: MLSTM_BENCH_COMMIT where set (a copy run elsewhere), else HEAD."""
    return os.environ.get("MLSTM_BENCH_COMMIT", "").removesuffix("-dirty") or "HEAD"


def measured_objects(benchmark: str, revision: str = "HEAD", repo: Path = REPO) -> dict[str, str | None]:
    """The git object id of each path ``benchmark`` measures (``MEASURES``) at ``revision`` (None for a path
    it lacks): what a record keeps, so that the page can tell whether today's code is the code it
    measured without the record's commit. Empty without git or for a benchmark not named there."""
    objects: dict[str, str | None] = {}
    for path in MEASURES.get(benchmark, ()):
        try:
            found = subprocess.run(
                ["git", "rev-parse", "--verify", "--quiet", f"{revision}:{path.rstrip('/')}"],
                cwd=repo,
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError:
            return {}
        if found.returncode > 1:
            return {}
        objects[path] = found.stdout.strip() or None
    return objects if any(objects.values()) else {}  # no such revision here (a copy run elsewhere)


# The code each benchmark measures, by the ``benchmark`` name its records carry: a record made before the
# last commit that changed one of these paths measured other code, and the rendered page says so
# (render.py's ``stale_line``). A benchmark not named here is not checked.
MEASURES: dict[str, tuple[str, ...]] = {
    "baseline": ("tasks/transfer/baseline.py",),
    "cli": ("flows/cli/",),
    "corpus": ("tasks/corpus/",),
    "corpus_delta": ("tasks/corpus/",),
    "continue": ("tasks/pretrain/mix.py", "tasks/pretrain/parent.py"),
    "features": ("models/features.py", "models/mlstm.py", "models/recurrence.py", "tasks/transfer/serve.py"),
    "finetune": ("tasks/finetune/", "models/finetuned.py"),
    "finetune-select": ("tasks/finetune/", "models/finetuned.py"),
    "gpu-check": ("models/", "tasks/pretrain/", "tasks/transfer/solvers/"),
    "job": ("tasks/jobs/checkpoint.py", "tasks/jobs/checkpointer.py", "tasks/jobs/world.py"),
    "neuron": ("tasks/transfer/explain.py", "models/neuron.py"),
    "pipeline": ("tasks/pipeline/", "flows/pipeline.py"),
    "pretrain": (
        "models/mlstm.py",
        "models/recurrence.py",
        "tasks/pretrain/step.py",
        "tasks/pretrain/graphed.py",
    ),
    "probe": ("tasks/transfer/solvers/",),
    "score_fixed": ("flows/score.py", "flows/runtime.py", "flows/stopping.py", "flows/cli/score.py"),
    "scaling": ("models/mlstm.py", "models/recurrence.py"),
    "score": ("tasks/score/", "models/features.py"),
    "sharding": ("tasks/jobs/sharding.py", "tasks/pretrain/step.py"),
    "sweep": ("tasks/sweep/",),
    "threads": ("tasks/jobs/threads.py", "models/mlstm.py", "models/recurrence.py"),
    "weekly": (
        "tasks/pipeline/",
        "flows/pipeline.py",
        "tasks/corpus/delta.py",
        "tasks/corpus/grow.py",
        "tasks/pretrain/mix.py",
        "tasks/pretrain/parent.py",
    ),
}


# The parts of the probe's goal (issue 27) as a row of benchmarks/probe.py keeps them, and as its
# verdict names the ones a row misses.
PROBE_GOAL_PARTS = {"met": "speed-up", "same_answer": "C or test accuracy", "objective": "objective"}


def precision_line(row: dict[str, Any], first: dict[str, Any]) -> str:
    """The sentence comparing a feature row with its preset's first precision's (``--precisions``): its
    fast path's rate and how far its features are from the first's. The benchmark's output and the
    rendered page say the same."""
    return (
        f"{row['preset']}: {row['precision']} reads {row['vs_first_precision']:.2f}× {first['precision']}'s "
        f"chars/s; its features differ from {first['precision']}'s by {row['first_precision_rel_diff']:.1e} "
        "at most (relative to each text's largest)."
    )


# A probe row's refits at a tight tolerance, where its answer parted from liblinear's: each a sentence.
TIGHTENED = ("liblinear_tightened", "solver_tightened")


def tightened_line(row: dict[str, Any], key: str = "liblinear_tightened") -> str:
    """The sentence for a probe row whose answer parted from liblinear's, refitted at a tight tolerance at
    both chosen C: liblinear (``liblinear_tightened``) or the row's solver (``solver_tightened``, along its
    path). Per C its objective, how far above the minimum it can be (its duality gap, relative), both
    sweeps' objectives, its dev and test accuracy, and the C its dev accuracy picks. The benchmark's
    output and the rendered page say the same."""
    tight = row[key]
    who, default = (
        ("liblinear", "1e-4") if key == "liblinear_tightened" else (row["solver"], tight["default_tol"])
    )
    if "skipped" in tight:
        return f"{row['case']}: {who} not refitted at tol {tight['tol']:g} at the two chosen C: {tight['skipped']}."
    sweep = {p["C"]: p for p in row["per_C"]}
    parts = [
        f"C = {p['C']:g}: objective {p['objective']:.9g} ("
        # Records before the certificate have none.
        + (
            f"at most {p['duality_gap']:.1e} above the minimum: its duality gap; "
            if "duality_gap" in p
            else ""
        )
        + f"liblinear's sweep {sweep[p['C']]['objective'][0]:.9g}, {row['solver']}'s "
        f"{sweep[p['C']]['objective'][1]:.9g}), dev {p['dev_accuracy']}, test {p['test_accuracy']}"
        for p in tight["per_C"]
    ]
    other, other_C = (row["solver"], row["C"][1]) if who == "liblinear" else ("liblinear", row["C"][0])
    # Records before the gap-certified refit tried one tolerance and say none.
    earlier = ", ".join(f"{tol:g}" for tol in tight.get("tried", [])[:-1])
    return (
        f"{row['case']}: {who} refitted at tol {tight['tol']:g} (its default {default}"
        + (f"; at {earlier} a duality gap was above {tight['certified_gap']:g}" if earlier else "")
        + ")"
        + ("" if who == "liblinear" else " along its path")
        + " at the two chosen C: "
        + "; ".join(parts)
        + f"; its dev accuracy picks C = {tight['C']:g} ({other} chose {other_C:g})."
    )


def probe_goal_misses(verdicts: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """``case (part, …)`` for each (case, goal) that misses a part of the goal: what the table's last line
    names, in the benchmark's output and on the rendered page alike."""
    return [
        f"{case} ({', '.join(name for key, name in PROBE_GOAL_PARTS.items() if not goal[key])})"
        for case, goal in verdicts
        if not all(goal[key] for key in PROBE_GOAL_PARTS)
    ]


def timed_cli(args: list[str], env: dict[str, str], cwd: Path) -> tuple[float, dict[str, Any]]:
    """``mlstm-sentiment ARGS --json`` run as a user runs it (this interpreter's console script): its wall
    seconds, start-up included, and its ``--json`` result; a failed command stops the benchmark."""
    import time

    started = time.perf_counter()
    command = [str(Path(sys.executable).parent / "mlstm-sentiment"), *args, "--json"]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"`mlstm-sentiment {' '.join(args)}` failed:\n{done.stderr}")
    return seconds, json.loads(done.stdout)
