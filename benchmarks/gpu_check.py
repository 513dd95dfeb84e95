#!/usr/bin/env python
"""Every GPU path of the project in one command, each part under its own time limit; one table last.

    make gpu-check                                        # PYTHONPATH=. python3 benchmarks/gpu_check.py
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_check.py --rehearse     # the parts at toy sizes, CPU

On a machine with one CUDA GPU, with only the working tree and the few wheels that
``tasks.pretrain.train`` needs beside torch (pydantic, pydantic-settings and theirs: no Prefect,
MLflow or boto3), the parts, in order:

- pretrain: ``benchmarks/pretrain.py``: paper_4096 in bf16 at batch 256 and 512, the captured
  (graphed), eager (fused) and step-by-step (reference) steps, MFU against the matmul peak measured in
  the same run, the memory planner's figure beside ``torch.cuda.max_memory_allocated``, and one
  profiled step (``--profile``: where the time goes);
- features: ``benchmarks/features.py``: paper_4096 on IMDB test reviews in bf16 (the shared data
  under ``MLSTM_SHARED_DIR``; the generated sample, said so, where it is absent);
- probe: ``benchmarks/probe.py``: the 4096-wide SST-sized sweep on the GPU (newton)
  against liblinear's sweep as recorded on a CPU (``benchmarks/results/probe-cpu.json``);
- tests: every ``-m gpu`` test (``tests/test_gpu.py``, ``tests/test_probe_solver.py``);
- job: ``benchmarks/job.py``: a real one-GPU job through torchrun, small preset, preempted by SIGTERM
  and resumed, against the same job left alone: captured (``--sharding none``) and FSDP2 with DCP
  checkpoints (``--sharding full`` on one rank), with the checkpoint's save and load seconds;
- scaling: ``benchmarks/scaling.py`` on the measured eager step (what each rank of a DDP job runs);
- render: ``docs/benchmarks.md`` rendered again from the result files.

Each part is a process of its own, killed at its limit (``--budget`` caps the whole: a part gets what
is left), so a hang costs that part only. The tests run beside the job (each launches the training
job, and a launch's start is most of their time; neither is timed against a goal); the others one at a
time. The benchmarks write their ``--record gpu`` files
(``benchmarks/results/NAME-gpu.json``, the GPU named in each); this command writes its summary to
``benchmarks/results/gpu-check.json`` and every part's output to ``--logs``. The goals (issue 26): the
graphed step ≥ 55 % MFU at batch 256 and ≥ 60 % at 512; features ≥ 2.5M chars/s; the probe sweep ≤ 10 s;
(issue 54) the whole check ≤ 7 minutes: the parts' limits span 6.5 (``span_s``), each part killed at
its own. The learning curve (``make gpu-learn``, ``benchmarks/gpu_learn.py``) is a command of its own.

Where the checkout's copy has a stale ``.git`` or none (a tree sent to a lent machine), name the commit
it holds in ``MLSTM_BENCH_COMMIT``: the records say which code they measured (the H200 run of
2026-11-27 first recorded its device copy's stale commit).

Without a GPU it says so in one line and exits 2. ``--rehearse`` runs every part on the CPU at toy
sizes instead, writing only to ``--logs``: the command's own check where no GPU is (nothing recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (  # the working tree on the path
    REPO,
    RESULTS,
    checkout_path,
    machine,
    new_parser,
    record,
    say,
)

from tasks.processes import stop_group  # PYTHONPATH=. : the checkout's package (stdlib only)

GOAL_FEATURES_CHARS_PER_S = 2.5e6
# Issue 54: the whole check in at most 7 minutes on one GPU; the parts' limits span 6.5 of them, so a
# part that runs to its limit still leaves the machine's own start and the transfers room.
BUDGET_S = 390
CHECK_GOAL_S = 420
KILL_GRACE_S = 10


@dataclasses.dataclass
class Part:
    name: str
    limit_s: float
    argv: list[str]  # after the interpreter
    summarise: Callable[[Path], tuple[bool, str, dict[str, Any]]]  # logs → (ok, one line, figures)
    stdout_json: bool = False  # the script prints its JSON report on stdout (benchmarks/probe.py)
    beside_next: bool = False  # runs at the same time as the next part (neither is a timing benchmark)


@dataclasses.dataclass
class Outcome:
    part: str
    status: str  # passed, failed, timed out, not run
    seconds: float
    limit_s: float
    line: str
    figures: dict[str, Any]


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def summarise_pretrain(logs: Path) -> tuple[bool, str, dict[str, Any]]:
    report = _json(logs / "pretrain.json")
    rows = report["rows"]
    memory = [
        {
            "impl": r["impl"],
            "batch": r["batch"],
            "planned_gib": r["planned_allocated_bytes"] / 2**30,
            "measured_gib": r["peak_memory_bytes"] / 2**30,
            "planned_over_measured": r["planned_allocated_bytes"] / max(r["peak_memory_bytes"], 1),
        }
        for r in rows
        if r.get("planned_allocated_bytes") and r["status"] == "ok"
    ]
    goals = [g for g in report["goal"] if g["applies"]]
    parts = [f"{g['impl']} b{g['batch']} MFU {g['mfu']:.1%} (goal {g['mfu_goal']:.0%})" for g in goals]
    parts += [
        f"{r['impl']} b{r['batch']} {r['mfu']:.1%}"
        for r in rows
        if r["mfu"] is not None and r["impl"] != (goals[0]["impl"] if goals else None)
    ]
    parts += [f"plan/alloc {m['impl']} b{m['batch']} {m['planned_over_measured']:.2f}" for m in memory]
    ok = not report["checks_failed"] and all(r["status"] == "ok" or r["impl"] == "reference" for r in rows)
    figures = {"goals": goals, "memory": memory, "checks_failed": report["checks_failed"]}
    return ok, "; ".join(parts) or "no rows", figures


def summarise_features(logs: Path) -> tuple[bool, str, dict[str, Any]]:
    report = _json(logs / "features.json")
    line, goals = [], []
    for r in report["features"]:
        met = r["chars_per_s"] >= GOAL_FEATURES_CHARS_PER_S
        goals.append({"preset": r["preset"], "chars_per_s": r["chars_per_s"], "met": met})
        line.append(
            f"{r['preset']} {r['chars_per_s']:,.0f} chars/s (goal {GOAL_FEATURES_CHARS_PER_S:,.0f}), "
            f"{r['vs_reference']:.2f}× reference, {r['rows']} rows × {r['steps']:,} steps "
            f"({r['idle']:.1%} idle), diff {r['max_rel_diff']:.1e}"
        )
    source = report["texts_source"]
    line.append("IMDB texts" if "imdb" in source else f"texts: {source}")
    return not report["checks_failed"], "; ".join(line), {"goals": goals, "texts": source}


def summarise_probe(logs: Path) -> tuple[bool, str, dict[str, Any]]:
    """Each solver must choose liblinear's C (or one with its dev accuracy) and reach its test accuracy
    within half a point; along the path they may part where liblinear stops short at the large-C end."""
    report = _json(logs / "probe.json")
    # A speed-up only where liblinear ran in the same run: --liblinear-from times it elsewhere, earlier.
    one_run = not report.get("liblinear_source")
    line = [
        f"{r['case']} {r['solver']} {r['solver_s']} s ("
        + (f"{r['speedup']}× liblinear, " if one_run else "")
        + f"C {r['C'][0]:g}/{r['C'][1]:g})"
        for r in report["rows"]
    ]
    goal = report["goal"]
    if goal["applies"]:
        line.append(f"goal ≤ {goal['goal_s']:g} s {'met' if goal['met'] else 'NOT met'}")
    same = all(
        abs(r["test_accuracy"][0] - r["test_accuracy"][1]) <= 0.005
        and (r["C"][0] == r["C"][1] or abs(r["dev_accuracy"][0] - r["dev_accuracy"][1]) <= 0.005)
        for r in report["rows"]
    )
    return same, "; ".join(line), {"goal": goal, "rows": report["rows"]}


def summarise_tests(logs: Path) -> tuple[bool, str, dict[str, Any]]:
    suite = ElementTree.parse(logs / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [
        case.get("name", "?")
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    line = f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
    if failed:
        line += ": " + ", ".join(failed)
    return not failed and passed + counts["skipped"] > 0, line, {**counts, "passed": passed, "failed": failed}


def summarise_job(logs: Path) -> tuple[bool, str, dict[str, Any]]:
    report = _json(logs / "job.json")
    line = [
        f"{r['sharding']}: SIGTERM at {r['signalled_at']}, checkpoint {r['checkpointed_at']} "
        f"(save {r['checkpoint_save_s']} s, load {r['checkpoint_load_s']} s), resumed "
        f"{'=' if r['equal'] else '≠'} straight (weights {r['max_weight_rel_diff']:.1e})"
        for r in report["rows"]
    ]
    return all(r["equal"] for r in report["rows"]), "; ".join(line), {"rows": report["rows"]}


def summarise_exit(logs: Path) -> tuple[bool, str, dict[str, Any]]:
    return True, "", {}


def parts(args: argparse.Namespace, logs: Path) -> list[Part]:
    """The parts with their command lines: the issue's sizes on a GPU, toy ones in a rehearsal."""
    tests = ["-m", "pytest", "tests/test_gpu.py", "tests/test_probe_solver.py", "-m", "gpu", "-q"]
    tests += ["-p", "no:cacheprovider", "--junitxml", str(logs / "tests.xml")]
    tests += ["-k", args.tests_k] if args.tests_k else []
    if args.rehearse:
        pretrain = ["--presets", "tiny", "--batch", "8", "--seq-len", "16", "--steps", "2", "--warmup", "1"]
        pretrain += ["--impls", "fused,reference", "--no-baseline", "--matmul-size", "256"]
        features = ["--presets", "tiny", "--texts", "32", "--baseline-texts", "4"]
        probe = ["--cases", "sst:256", "--c-max-log2", "-5", "--solvers", "newton"]
        record: list[str] = []
    else:
        pretrain = ["--presets", "paper_4096", "--batch", "256,512", "--precision", "bf16"]
        pretrain += ["--impls", "graphed,fused,reference", "--no-baseline"]
        features = ["--presets", "paper_4096"]
        probe = ["--cases", "sst:4096", "--solvers", "newton"]
        probe += ["--liblinear-from", str(RESULTS / "probe-cpu.json")]
        record = ["--record", "gpu"]
    pretrain += ["--json", str(logs / "pretrain.json"), "--profile", str(logs / "pretrain-profile.txt")]
    features += ["--no-serve", "--json", str(logs / "features.json")]
    features += ["--profile", str(logs / "features-profile.txt")]
    job = ["--keep-logs", str(logs / "job-logs"), "--json", str(logs / "job.json")]
    chosen = [
        # Limits about 1.4 times each part's time on the H200 (2026-11-27: 69, 64 and 25 s).
        Part("pretrain", 100, ["benchmarks/pretrain.py", *pretrain, *record], summarise_pretrain),
        Part("features", 75, ["benchmarks/features.py", *features, *record], summarise_features),
        Part(
            "probe", 40, ["benchmarks/probe.py", *probe, "--json", *record], summarise_probe, stdout_json=True
        ),
        # The tests and the job launch the training job eight times between them, each launch paying
        # its start (imports, compilation, capture: about half a minute on an H200's host): one after
        # the other they took 333 s of the 2026-11-27 check. Now the job's launches run two and four at
        # a time, the tests share one captured run (two launches, not three), and both run side by
        # side. Neither times anything the goals read.
        Part("tests", 130, tests, summarise_tests, beside_next=True),
        Part("job", 130, ["benchmarks/job.py", *job, *record], summarise_job),
    ]
    if not args.rehearse:
        scaling = ["benchmarks/scaling.py", "--from-json", str(logs / "pretrain.json"), "--record", "gpu"]
        chosen += [
            Part("scaling", 15, scaling, summarise_exit),
            Part("render", 15, ["benchmarks/render.py"], summarise_exit),
        ]
    return [p for p in chosen if p.name in args.parts]


def span_s(chosen: list[Part]) -> float:
    """The longest the parts can take, each to its limit: a part beside the next counts with it as
    the longer of the two."""
    total, beside = 0.0, 0.0
    for part in chosen:
        if part.beside_next:
            beside = max(beside, part.limit_s)
            continue
        total += max(beside, part.limit_s)
        beside = 0.0
    return total + beside


@dataclasses.dataclass
class Running:
    part: Part
    limit_s: float
    process: subprocess.Popen[bytes]
    started: float
    files: list[Any]


def start_part(part: Part, limit_s: float, logs: Path) -> Running:
    """The part as a process of its own (its own process group), to be killed at ``limit_s``."""
    say(f"[gpu-check] {part.name}: python {' '.join(part.argv)} (limit {limit_s:.0f} s)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": checkout_path()}
    out = (logs / f"{part.name}.log").open("wb")
    report = (logs / f"{part.name}.json").open("wb") if part.stdout_json else None
    process = subprocess.Popen(
        [sys.executable, *part.argv],
        cwd=REPO,
        env=env,
        stdout=report or out,
        stderr=out if report else subprocess.STDOUT,
        start_new_session=True,  # its own process group: a timeout stops its children too
    )
    return Running(part, limit_s, process, time.monotonic(), [f for f in (out, report) if f])


def finish_part(running: Running, logs: Path) -> Outcome:
    """Wait for the part until its limit (counted from its start), then summarise its report."""
    part, log = running.part, logs / f"{running.part.name}.log"
    try:
        left = running.limit_s - (time.monotonic() - running.started)
        code = running.process.wait(timeout=max(left, 0.01))
    except subprocess.TimeoutExpired:
        stop_group(running.process, grace=KILL_GRACE_S)
        return Outcome(
            part.name, "timed out", time.monotonic() - running.started, running.limit_s, _tail(log), {}
        )
    finally:
        for file in running.files:
            file.close()
    seconds = time.monotonic() - running.started
    try:
        ok, line, figures = part.summarise(logs)
    except (OSError, ValueError, KeyError, IndexError, ElementTree.ParseError) as error:
        ok, line, figures = False, f"no report ({type(error).__name__}: {error})", {}
    if code != 0:
        ok, line = False, f"exit {code}; {line or _tail(log)}"
    return Outcome(part.name, "passed" if ok else "failed", seconds, running.limit_s, line, figures)


def finish_and_say(running: Running, logs: Path) -> Outcome:
    """The part finished, its line said (and its log's end where it did not pass)."""
    outcome = finish_part(running, logs)
    say(f"[gpu-check] {outcome.part}: {outcome.status} in {outcome.seconds:.0f} s: {outcome.line}")
    if outcome.status != "passed":
        log = logs / f"{outcome.part}.log"
        say(f"[gpu-check] {outcome.part}: the end of {log}:\n{_tail(log, 15)}")
    return outcome


def _tail(log: Path, lines: int = 1) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return " | ".join(text[-lines:])[-300:]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = ["pretrain", "features", "probe", "tests", "job", "scaling", "render"]
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="Seconds for all parts together.")
    parser.add_argument("--parts", default=",".join(names), help="Comma-separated, of " + ", ".join(names))
    parser.add_argument(
        "--logs", type=Path, help="Folder for every part's output (default: a new temporary one)."
    )
    parser.add_argument(
        "--rehearse", action="store_true", help="The parts at toy sizes on the CPU; nothing recorded."
    )
    parser.add_argument("--tests-k", metavar="EXPR", help="Only the -m gpu tests pytest -k EXPR selects.")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="Keep the recorded outcome of every part not run now (a rerun of the parts that failed).",
    )
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in args.parts if p not in names]:
        parser.error(f"--parts: {', '.join(unknown)} is not one of {', '.join(names)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print(
            f"gpu-check: {sys.executable} has no torch: run it with the GPU machine's Python", file=sys.stderr
        )
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.rehearse:
        print(
            f"gpu-check: torch {torch.__version__} sees no CUDA device: nothing run "
            "(--rehearse runs the parts at toy sizes on the CPU)",
            file=sys.stderr,
        )
        return 2
    logs = args.logs or Path(tempfile.mkdtemp(prefix="mlstm-gpu-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if cuda and not args.rehearse else "cpu")
    info = machine(device)
    say(f"[gpu-check] on {info.get('gpu') or info['cpu']}; logs in {logs}; budget {args.budget:.0f} s")
    chosen = parts(args, logs)
    if span_s(chosen) > args.budget:
        say(
            f"[gpu-check] the parts' limits span {span_s(chosen):.0f} s, over the {args.budget:.0f} s "
            "budget: the last parts get what is left, or are not run"
        )
    deadline = time.monotonic() + args.budget
    outcomes: list[Outcome] = []
    running: list[Running] = []
    for part in chosen:
        left = deadline - time.monotonic()
        if left < 5:
            outcomes.append(Outcome(part.name, "not run", 0.0, part.limit_s, "the budget was spent", {}))
            continue
        running.append(start_part(part, min(part.limit_s, left), logs))
        if part.beside_next:
            continue
        outcomes += [finish_and_say(run, logs) for run in running]
        running = []
    # A part meant to run beside one that --parts left out, or that the spent budget did not start.
    outcomes += [finish_and_say(run, logs) for run in running]
    report = {
        "machine": info,
        "rehearsal": args.rehearse,
        "budget_s": args.budget,
        "span_s": span_s(chosen),
        "goal_s": CHECK_GOAL_S,
        "seconds": time.monotonic() - (deadline - args.budget),
        "parts": [dataclasses.asdict(o) for o in outcomes],
    }
    if args.merge and not args.rehearse:
        now = {o.part for o in outcomes}
        report["parts"] = merged(report["parts"], RESULTS / "gpu-check.json", info)
        report["seconds"] += sum(p["seconds"] for p in report["parts"] if p["part"] not in now)
    (logs / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.rehearse:
        record("gpu-check", "", report, argv=argv, script="gpu_check")
    print_table(outcomes, info, report["seconds"])
    return 0 if all(o.status == "passed" for o in outcomes) else 1


def merged(parts: list[dict[str, Any]], path: Path, info: dict[str, Any]) -> list[dict[str, Any]]:
    """This run's parts, and the recorded outcome of every other part of the same GPU's last check."""
    if not path.is_file():
        return parts
    document = json.loads(path.read_text())
    if document["machine"].get("gpu") != info.get("gpu"):
        return parts
    now = {p["part"]: p for p in parts}
    recorded = [p["part"] for p in document["results"]["parts"]]
    earlier = {
        p["part"]: {**p, "line": f"(recorded {document['date']}) {p['line']}"}
        for p in document["results"]["parts"]
        if p["part"] not in now
    }
    names = [*recorded, *(name for name in now if name not in recorded)]
    return [now.get(name) or earlier[name] for name in names]


def print_table(outcomes: list[Outcome], info: dict[str, Any], seconds: float) -> None:
    where = info.get("gpu") or f"CPU ({info['cpu']})"
    goal = f"goal ≤ {CHECK_GOAL_S} s {'met' if seconds <= CHECK_GOAL_S else 'NOT met'}"
    print(f"\ngpu-check on {where}, torch {info['torch']}: {seconds:.0f} s ({goal})")
    print("| part | status | seconds (limit) | result |")
    print("|---|---|---|---|")
    for o in outcomes:
        print(f"| {o.part} | {o.status} | {o.seconds:.0f} ({o.limit_s:.0f}) | {o.line} |")


if __name__ == "__main__":
    sys.exit(main())
