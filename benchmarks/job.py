#!/usr/bin/env python
"""A real training job preempted and resumed, against the same job left alone, in one run.

For each ``--sharding``, three launches of ``torchrun -m tasks.pretrain.train`` on one rank (the GPU
when torch sees one, else the CPU), through ``tasks.jobs.launchers.local.LocalLauncher`` as the
pipeline launches them, on a corpus built from the project's generated sample
(``tasks.corpus.sample.write_sample``, the plain build functions):

- straight: ``--max-steps N``, left alone (the baseline);
- preempted: the same settings under another run name, sent SIGTERM (as Slurm or Kubernetes would)
  once its log shows step ``--signal-at``: it must checkpoint at the step it reached and exit;
- resumed: that run launched again with the same name: it must resume from that checkpoint and end at
  step N where the straight run ended: the final loss and every weight within the precision's rounding
  (bf16 on a GPU: the embedding's backward adds in a non-deterministic order; fp32 on the CPU).

``none`` on one GPU is the step captured as a CUDA graph; ``full`` is FSDP2 over a world of one, its
checkpoints DCP files (``tasks/jobs/sharding.py``). The report gives each launch's chars/s, the
checkpoint's save and load seconds (from the job's own log lines), and the largest difference.
On a GPU the launches run side by side (``--at-once``): each straight run beside its preempted one,
every sharding at the same time, so the check pays two launches' starts, not six (the 2026-11-27 H200
check spent 200 s on six, about 27 s of each one its start); the chars/s are then read with the others
beside them. On a CPU they run one at a time (``--no-at-once``).
``--tracking off`` by default: the job's metrics stay in its log, so MLflow need not be installed.

    PYTHONPATH=. python benchmarks/job.py --record gpu                    # small preset, on a GPU
    PYTHONPATH=. .venv/bin/python benchmarks/job.py --preset tiny --batch 8 --seq-len 32 --steps 24 \\
        --signal-at 8 --log-every 4 --json job.json                       # minutes on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from common import (  # the working tree on the path
    add_record_option,
    checkout_path,
    machine,
    new_parser,
    record,
    say,
)

from models.precision import PRECISION_NAMES, resolve_precision
from tasks.jobs.checkpoint import load_checkpoint
from tasks.jobs.config import SHARDINGS
from tasks.jobs.launchers.base import JobHandle, JobSpec
from tasks.jobs.launchers.local import LocalLauncher
from tasks.pretrain.stage import JOB_MODULE

# The largest relative difference (‖resumed − straight‖ / ‖straight‖ per weight, and of the final loss)
# that still counts as the same run: bf16 kernels add in another order from launch to launch.
TOLERANCE = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-5}
JOB_TIMEOUT_S = 300


def build_corpus(root: Path) -> str:
    """A corpus of the generated sample, built with the plain functions (no Prefect); its manifest URI."""
    from tasks.corpus.build import CorpusConfig, build_in_process, plan_corpus
    from tasks.corpus.sample import write_sample
    from tasks.store import LocalStore

    files = write_sample(root / "raw", num_reviews=3000)
    plan = plan_corpus([str(f) for f in files], CorpusConfig(split=(18, 1, 1)))
    manifest = build_in_process(plan, LocalStore(root / "store"))
    return str(root / "store" / "corpora" / manifest.corpus_id / "manifest.json")


class Jobs:
    """Launches of the job in one home (store, caches), each with its log."""

    def __init__(self, home: Path, common: list[str]) -> None:
        self.home, self.common = home, common
        self.launcher = LocalLauncher()

    def start(self, name: str, args: list[str]) -> JobHandle:
        spec = JobSpec(
            name=name,
            args=(*self.common, *args),
            module=JOB_MODULE,
            # The job runs this checkout, as the benchmark does, not a copy the environment installed.
            env={"MLSTM_HOME": str(self.home), "PYTHONPATH": checkout_path()},
            workdir=self.home / "jobs",
        )
        say(f"  {name}: {shlex.join(spec.args)}")
        return self.launcher.submit(spec)

    def finish(self, handle: JobHandle) -> str:
        status = self.launcher.wait(handle, poll_seconds=0.2, timeout=JOB_TIMEOUT_S)
        log = Path(handle.log_path).read_text()
        if status.exit_code != 0:
            raise RuntimeError(f"the job exited with {status.exit_code}:\n{log[-3000:]}")
        return log

    def interrupt_at(self, handle: JobHandle, step: int) -> str:
        """SIGTERM once the log shows ``step`` (the launcher's cancel, as a flow run's cancellation)."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        path = Path(handle.log_path)
        while f"progress step={step} " not in path.read_text():
            if self.launcher.status(handle).state.finished:
                raise RuntimeError(f"the job ended before step {step}:\n{path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not reach step {step} in {JOB_TIMEOUT_S} s")
            time.sleep(0.05)
        self.launcher.cancel(handle)
        return path.read_text()


def result_of(log: str) -> dict[str, Any]:
    return dict(json.loads(log.rpartition("result ")[2].splitlines()[0]))


def chars_per_s(log: str) -> float | None:
    """The job's own rate: the mean of its progress lines' chars_per_s after the first (compilation)."""
    rates = [float(m) for m in re.findall(r"^progress .*?chars_per_s=([0-9.e+-]+)", log, re.MULTILINE)]
    return sum(rates[1:]) / len(rates[1:]) if len(rates) > 1 else None


def seconds_after(log: str, pattern: str) -> float | None:
    found = re.search(pattern + r".*? in ([0-9.]+) s", log)
    return float(found.group(1)) if found else None


def relative_differences(straight_uri: str, resumed_uri: str) -> dict[str, float]:
    """‖resumed − straight‖ / ‖straight‖ of every weight of the two final checkpoints."""
    a = load_checkpoint(straight_uri).state["model"]
    b = load_checkpoint(resumed_uri).state["model"]
    return {
        name: float((b[name].double() - a[name].double()).norm() / a[name].double().norm().clamp_min(1e-30))
        for name in a
    }


def check_sharding(
    jobs: Jobs, sharding: str, args: argparse.Namespace, device: torch.device, precision: str
) -> dict[str, Any]:
    flags = ["--sharding", sharding, "--max-steps", str(args.steps)]
    say(f"--sharding {sharding}: straight, preempted at step {args.signal_at}, resumed")
    started = time.perf_counter()
    straight_job = jobs.start(f"straight-{sharding}", [*flags, "--run-name", f"straight-{sharding}"])
    if not args.at_once:
        straight_log = jobs.finish(straight_job)
    run = ["--run-name", f"preempted-{sharding}"]
    preempted_log = jobs.interrupt_at(jobs.start(f"preempted-{sharding}", [*flags, *run]), args.signal_at)
    if args.at_once:  # the straight run went on beside the preempted one
        straight_log = jobs.finish(straight_job)
    straight_s = time.perf_counter() - started
    straight = result_of(straight_log)
    signalled = re.search(r"SIGTERM: checkpointed at step (\d+)", preempted_log)
    if not signalled:
        raise RuntimeError(f"SIGTERM did not checkpoint:\n{preempted_log[-3000:]}")
    checkpointed = int(signalled.group(1))

    resumed_log = jobs.finish(jobs.start(f"resumed-{sharding}", [*flags, *run]))
    resumed = result_of(resumed_log)
    if f"resumed run preempted-{sharding} from step {checkpointed} " not in resumed_log:
        raise RuntimeError(f"the relaunch did not resume from step {checkpointed}:\n{resumed_log[-3000:]}")
    weights = relative_differences(straight["checkpoint_uri"], resumed["checkpoint_uri"])
    worst = max(weights, key=weights.__getitem__)
    loss_difference = abs(resumed["final_loss"] - straight["final_loss"]) / abs(straight["final_loss"])
    tolerance = TOLERANCE[precision]
    return {
        "sharding": sharding,
        "steps": args.steps,
        "signalled_at": args.signal_at,
        "checkpointed_at": checkpointed,
        "straight_seconds": straight_s,
        "straight_chars_per_s": chars_per_s(straight_log),
        "resumed_chars_per_s": chars_per_s(resumed_log),
        "checkpoint_save_s": seconds_after(preempted_log, rf"checkpoint step={checkpointed} "),
        "checkpoint_load_s": seconds_after(resumed_log, r"resumed run "),
        "sharded_checkpoint": "DCP files" in preempted_log,
        "captured": sharding != "full" and device.type == "cuda",  # the job's --cuda-graph auto
        "final_loss": [straight["final_loss"], resumed["final_loss"]],
        "loss_rel_diff": loss_difference,
        "max_weight_rel_diff": weights[worst],
        "worst_weight": worst,
        "tolerance": tolerance,
        "equal": loss_difference <= tolerance and weights[worst] <= tolerance,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = new_parser(__doc__ or "", raw=True)
    cuda = torch.cuda.is_available()
    parser.add_argument("--preset", default="small" if cuda else "tiny")
    parser.add_argument("--batch", type=int, default=128 if cuda else 8, help="Rows per step.")
    parser.add_argument("--seq-len", type=int, default=256 if cuda else 32)
    parser.add_argument("--steps", type=int, default=100 if cuda else 24, help="Steps of every run.")
    parser.add_argument(
        "--signal-at",
        type=int,
        default=30 if cuda else 8,
        help="The preempted run's SIGTERM: after this step.",
    )
    parser.add_argument("--log-every", type=int, default=10 if cuda else 4)
    parser.add_argument(
        "--shardings", default="none,full", help=f"Comma-separated, of {', '.join(SHARDINGS)}."
    )
    parser.add_argument("--tracking", choices=("off", "mlflow"), default="off", help="The job's --tracking.")
    parser.add_argument(
        "--at-once",
        action=argparse.BooleanOptionalAction,
        default=cuda,
        help="Every sharding's launches side by side, each straight run beside its preempted one "
        "(default on a GPU: a launch's start is mostly the host's, and the GPU has room for four).",
    )
    parser.add_argument("--json", type=Path, dest="json_path", help="Also write the report to this file.")
    parser.add_argument(
        "--keep-logs", type=Path, metavar="DIR", help="Copy every launch's log here at the end."
    )
    add_record_option(parser)
    args = parser.parse_args(argv)
    args.shardings = [s.strip() for s in args.shardings.split(",") if s.strip()]
    if unknown := [s for s in args.shardings if s not in SHARDINGS]:
        parser.error(f"--shardings: {', '.join(unknown)} is not one of {', '.join(SHARDINGS)}")
    if not 0 < args.signal_at < args.steps or args.signal_at % args.log_every:
        parser.error("--signal-at must be a multiple of --log-every between 0 and --steps (a logged step)")
    return args


def run_checks(
    args: argparse.Namespace, scratch: Path, device: torch.device, precision: str
) -> list[dict[str, Any]]:
    home = scratch / "home"
    say("building a corpus of the generated sample …")
    manifest = build_corpus(scratch / "corpus")
    common = ["--corpus", manifest, "--store", str(home / "store"), "--preset", args.preset]
    common += ["--batch-size", str(args.batch), "--seq-len", str(args.seq_len), "--lr", "0.002"]
    common += ["--total-steps", str(args.steps), "--log-every", str(args.log_every)]
    common += ["--checkpoint-every", str(10 * args.steps), "--val-every", str(10 * args.steps)]
    common += ["--tracking", args.tracking]
    jobs = Jobs(home, common)
    # The jobs sign their checkpoints with this home's key (unless MLSTM_CHECKPOINT_KEY is set, for both):
    # this process reads them back under the same one, not under the checkout's own home's.
    with mock.patch.dict(os.environ, {"MLSTM_HOME": str(home)}):
        if not args.at_once:
            return [check_sharding(jobs, sharding, args, device, precision) for sharding in args.shardings]
        with ThreadPoolExecutor(len(args.shardings)) as pool:
            checks = [pool.submit(check_sharding, jobs, s, args, device, precision) for s in args.shardings]
            return [check.result() for check in checks]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = PRECISION_NAMES[resolve_precision("auto", device)]  # what the job's --precision auto runs
    # Stopped at a time limit (make gpu-check): still clean up, and keep the launches' logs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="mlstm-bench-job-") as scratch:
        try:
            rows = run_checks(args, Path(scratch), device, precision)
        finally:
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for log in (Path(scratch) / "home" / "jobs").glob("*.log"):
                    shutil.copy(log, args.keep_logs / log.name)
    lines = [
        f"Preempted and resumed against left alone: {args.preset}, batch {args.batch} × {args.seq_len}, "
        f"{args.steps} steps, SIGTERM after step {args.signal_at}, {precision} on {device}",
        "| sharding | checkpointed at | chars/s (straight, resumed) | save s | load s | loss rel diff "
        "| max weight rel diff | same run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rates = ", ".join(
            "—" if v is None else f"{v:,.0f}" for v in (r["straight_chars_per_s"], r["resumed_chars_per_s"])
        )
        lines.append(
            f"| {r['sharding']} | {r['checkpointed_at']} | {rates} | {r['checkpoint_save_s']} | "
            f"{r['checkpoint_load_s']} | {r['loss_rel_diff']:.1e} | {r['max_weight_rel_diff']:.1e} "
            f"({r['worst_weight']}) | {'yes' if r['equal'] else 'NO'} (≤ {r['tolerance']:g}) |"
        )
    print("\n".join(lines))
    settings = ("preset", "batch", "seq_len", "steps", "signal_at", "log_every", "shardings", "tracking")
    settings += ("at_once",)
    report = {
        "machine": machine(device),
        "settings": {k: getattr(args, k) for k in settings},
        "precision": precision,
        "rows": rows,
    }
    if args.json_path:
        args.json_path.write_text(json.dumps(report, indent=2) + "\n")
    record("job", args.record, report, argv=argv)
    failed = [r["sharding"] for r in rows if not r["equal"]]
    for sharding in failed:
        print(
            f"CHECK FAILED: --sharding {sharding}: the resumed run is not the straight one", file=sys.stderr
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
