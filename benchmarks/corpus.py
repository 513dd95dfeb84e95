#!/usr/bin/env python
"""Corpus build throughput against two baselines, measured in one run on the same input files.

The input is generated once from the shared Amazon files (2014, 2018 and 2023 layouts kept as they
are): every record is repeated with a unique tag appended to its review text, so dedupe keeps all of
them and the build does its full work. Rows, all on the same files, in MB/s of uncompressed input
(1 MB = 10**6 bytes):

- floor: pyarrow's C++ JSON reader (multi-threaded) writing plain Arrow IPC files;
- json.loads loop: one Python process reading line by line;
- full build (flow): ``flows.cli.corpus.run_corpus_build`` through Prefect with the process pool;
- full build (plain functions): the same stage functions in a ProcessPoolExecutor, without Prefect;
- second run: the flow build again, with the manifest already there;
- full build (flow, Dask N workers): the flow with ``MLSTM_TASK_RUNNER=dask``, its temporary local
  cluster of N worker processes (one thread each) started inside the timer, as the pool's workers are.

Peak RSS is sampled from /proc every 0.1 s over this process and all of its descendants.

This file holds the rows' runs, their checks, the report and the command line; the input is generated
by ``corpus_input.py`` and each row is timed and sampled by ``corpus_measure.py``, which
``corpus_delta.py`` shares.

    .venv/bin/python benchmarks/corpus.py --mb 500 --json bench.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import REPO, add_record_option, machine, new_parser, record, say  # the working tree on the path
from corpus_input import DEFAULT_SOURCE_DIR, MB, InputSet, open_input, prepare_inputs
from corpus_measure import Row, gib, in_workdir, measure

if TYPE_CHECKING:
    from tasks.corpus.manifest import Manifest

GOAL_RATIO = 0.60
GOAL_RSS = 1.5e9  # the 1.5 GB, read strictly (1.40 GiB)


# ---------------------------------------------------------------------------------------------
# Measurements


def run_floor(inputs: InputSet, out_dir: Path, *, explicit_schema: bool = True) -> dict[str, Any]:
    """pyarrow.json.read_json of each whole file (its default threaded reader), written as IPC."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    from tasks.corpus.reviews import RAW_SCHEMA

    # The build's own explicit schema: the same 16 fields, the rest (style, image, …) skipped;
    # or pyarrow's defaults, inferring every field of every record.
    parse = (
        pa_json.ParseOptions(explicit_schema=RAW_SCHEMA, unexpected_field_behavior="ignore")
        if explicit_schema
        else pa_json.ParseOptions()
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = 0
    for spec in inputs.files:
        path = Path(spec.path)
        table = pa_json.read_json(path, parse_options=parse)  # .gz is decompressed by its extension
        with pa.ipc.new_file(out_dir / f"{path.name}.arrow", table.schema) as writer:
            writer.write_table(table)
        rows += table.num_rows
        del table
    return {"rows": rows}


def run_loads_loop(inputs: InputSet) -> dict[str, Any]:
    """A single-process Python loop: json.loads every line and take its text; writes nothing."""
    records = text_chars = 0
    for spec in inputs.files:
        with open_input(Path(spec.path), "rb") as stream:
            for line in stream:
                record = json.loads(line)
                text = record.get("reviewText", record.get("text"))
                records += 1
                text_chars += len(text)
    return {"rows": records, "text_chars": text_chars}


def run_plain(inputs: InputSet, store_dir: Path, cache_path: Path, workers: int) -> dict[str, Any]:
    """plan → parse_piece in a process pool → reduce_bucket in the pool → manifest, without Prefect."""
    from tasks.corpus.build import (
        CorpusConfig,
        bucket_inputs,
        build_manifest,
        parse_piece,
        plan_corpus,
        publish_manifest,
        reduce_bucket,
    )
    from tasks.store import open_store

    windows: dict[str, tuple[float, float]] = {}
    called = time.perf_counter()

    def since() -> float:
        return time.perf_counter() - called

    store = open_store(str(store_dir))
    plan = plan_corpus([inputs.folder], CorpusConfig(), cache_path=cache_path)
    windows["plan"] = (0.0, since())
    # spawn, as Prefect's ProcessPoolTaskRunner does: the same worker start-up cost on both rows.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        mark = since()
        sent = plan.for_tasks()  # what the flow sends each task
        pieces = list(pool.map(parse_piece, *zip(*[(sent, p, store) for p in plan.pieces], strict=True)))
        windows["parse (with worker start)"] = (mark, since())
        mark = since()
        # A bucket's reduce reads only the pieces that wrote to it: it takes their ids.
        inputs = bucket_inputs(pieces, plan.num_buckets)
        reduce_args = [(sent, b, store, inputs[b]) for b in range(plan.num_buckets)]
        buckets = list(pool.map(reduce_bucket, *zip(*reduce_args, strict=True)))
        windows["reduce"] = (mark, since())
        mark = since()
    windows["worker shutdown"] = (mark, since())
    mark = since()
    manifest = build_manifest(plan, store, pieces, buckets)
    publish_manifest(plan, store, manifest)
    windows["manifest"] = (mark, since())
    return {
        "manifest": manifest,
        "windows": windows,
        "pieces": len(plan.pieces),
        "buckets": plan.num_buckets,
    }


def run_flow(inputs: InputSet, store_dir: Path, workers: int, runner: str = "process") -> dict[str, Any]:
    """The build as users run it: ``corpus build`` without the command line around it."""
    from flows.cli.corpus import run_corpus_build
    from tasks.corpus.build import CorpusConfig

    called = time.time()
    summary = run_corpus_build(
        [inputs.folder],
        store=str(store_dir),
        config=CorpusConfig(),
        task_runner=runner,  # type: ignore[arg-type]  # "process" or "dask"
        workers=workers,
        show_progress=False,
    )
    return {"summary": summary.model_dump(), "called": called}


def flow_windows(called: float) -> dict[str, tuple[float, float]]:
    """(start, end) of each stage of the latest flow run in seconds after the call, from the Prefect
    API's records of the flow run and its task runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        flow_runs = [r for r in client.read_flow_runs() if r.start_time is not None]
        flow_run = max(flow_runs, key=lambda r: r.start_time)  # type: ignore[arg-type,return-value]
        task_runs: list[Any] = []
        while True:  # the API returns at most 200 at a time
            page = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
                limit=200,
                offset=len(task_runs),
            )
            task_runs += page
            if len(page) < 200:
                break

    def at(moment: Any) -> float:
        return float(moment.timestamp() - called)

    windows = {"before the flow run (fingerprints)": (0.0, at(flow_run.start_time))}
    for stage in ("plan", "parse", "reduce"):
        runs = [t for t in task_runs if t.name.startswith(stage) and t.start_time and t.end_time]
        if runs:
            windows[f"{stage} tasks"] = (
                min(at(t.start_time) for t in runs),
                max(at(t.end_time) for t in runs),
            )
    if flow_run.end_time is not None:
        windows["after the tasks (manifest, MLflow, artifacts)"] = (
            max(end for _, end in windows.values()),
            at(flow_run.end_time),
        )
    return windows


def _manifest_of(summary: dict[str, Any]) -> Manifest:
    from tasks.corpus.manifest import load_manifest

    return load_manifest(summary["manifest_uri"])[2]


# ---------------------------------------------------------------------------------------------
# Checks and report


def check_manifest(label: str, manifest: Manifest, inputs: InputSet) -> list[str]:
    """Every generated record must be read, kept and written to a shard."""
    totals = manifest.totals.model_dump()
    rows = sum(split.rows for split in manifest.splits.values())
    problems = []
    expected = {"records": inputs.records, "kept": inputs.records, "duplicates": 0, "rejected": 0}
    for name, want in expected.items():
        if totals[name] != want:
            problems.append(f"{label}: manifest totals.{name} = {totals[name]:,}, expected {want:,}")
    if rows != inputs.records:
        problems.append(f"{label}: the splits hold {rows:,} rows, expected {inputs.records:,}")
    return problems


def shard_digests(manifest: Manifest) -> list[tuple[str, str]]:
    return sorted((s.path, s.sha256) for split in manifest.splits.values() for s in split.shards)


# The code the numbers belong to: the corpus stage and what it runs on.
CODE_FILES = (
    "tasks/corpus/build.py",
    "tasks/corpus/reviews.py",
    "tasks/corpus/sources.py",
    "tasks/store.py",
    "models/text.py",
    "flows/corpus.py",
    "flows/cli/corpus.py",
    "flows/runtime.py",
)


def code_digest() -> str:
    """sha256 over the stage's source files, to tell which code a set of numbers measured."""
    digest = hashlib.sha256()
    for name in CODE_FILES:
        digest.update(name.encode() + b"\0" + (REPO / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def print_report(rows: list[Row], inputs: InputSet, info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 180)
    console.print(
        f"{info['cores']} cores ({info['cpu']}), {info['ram_gib']} GiB RAM, Python {info['python']}, "
        f"pyarrow {info['pyarrow']}, prefect {info['prefect']}",
        highlight=False,
    )
    table = Table(
        title=f"Corpus build vs. baselines: {inputs.bytes / MB:,.1f} MB uncompressed, "
        f"{inputs.records:,} records, {len(inputs.files)} {'.json.gz' if inputs.gzip else 'plain JSON'} files"
    )
    columns = ("", "seconds", "MB/s", "vs floor", "peak RSS tree", "(anon)", "peak RSS 1 proc", "CPU s")
    for column in columns:
        table.add_column(column, justify="right" if column else "left", no_wrap=True)
    table.add_column("notes", overflow="fold")
    for row in rows:
        table.add_row(
            row.name,
            f"{row.seconds:.2f}",
            "—" if row.mb_per_s is None else f"{row.mb_per_s:.1f}",
            "—" if row.ratio_vs_floor is None else f"{row.ratio_vs_floor:.2f}",
            gib(row.peaks.tree),
            gib(row.peaks.tree_anon),
            gib(row.peaks.process),
            f"{row.cpu_seconds:.1f}",
            row.notes,
        )
    console.print(table)
    console.print(f"corpus code digest {code_digest()} (sha256 of {', '.join(CODE_FILES)})", highlight=False)
    for row in rows:
        console.print(f"  {row.name}: runs {', '.join(f'{r:.2f}' for r in row.runs)} s", highlight=False)
        cpu = " · ".join(f"{k} {v:.1f}" for k, v in row.details["cpu_seconds_by_role"].items() if v)
        console.print(
            f"    RSS of the tree when the timer started: {gib(row.details['rss_tree_at_start'])}; "
            f"CPU s: {cpu or '0'}",
            highlight=False,
        )
        peaks = row.details.get("peak_rss_tree_by_stage", {})
        for stage, (begin, end) in row.details.get("windows", {}).items():
            console.print(
                f"    {stage}: {begin:.1f} → {end:.1f} s ({end - begin:.1f} s), "
                f"peak RSS tree {gib(peaks.get(stage, 0))}",
                highlight=False,
            )


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = new_parser(
        (
            "Benchmark the corpus build against pyarrow's JSON reader (the floor for parse + write) "
            "and a json.loads loop, on the same generated copies of the shared Amazon review files."
        ),
    )
    parser.add_argument("--mb", type=float, default=500, help="Input size to generate, MB uncompressed.")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="Keep the generated input here and reuse it next time (default: a temporary folder).",
    )
    parser.add_argument(
        "--source-dir", type=Path, default=DEFAULT_SOURCE_DIR, help="The shared Amazon review files."
    )
    parser.add_argument("--partial", action="store_true", help="Also copy the partial/ slices.")
    parser.add_argument("--gzip", action="store_true", help="Write the input as .json.gz (default: plain).")
    parser.add_argument("--workers", type=int, default=2, help="Worker processes of both builds.")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="Runs of each row; the fastest is reported, the peaks are the highest of all runs.",
    )
    parser.add_argument(
        "--dask-workers",
        default="1,2",
        help="Worker counts of the Dask rows, comma-separated; empty for none (needs the dask extra).",
    )
    parser.add_argument("--json", type=Path, dest="json_path", help="Also write the numbers to this file.")
    add_record_option(parser)
    return parser.parse_args(argv)


def measure_dask(
    args: argparse.Namespace,
    inputs: InputSet,
    run_dir: Path,
    problems: list[str],
    digests: list[list[tuple[str, str]]],
) -> list[Row]:
    """The flow build on a temporary local Dask cluster of each --dask-workers size."""
    import importlib.util

    counts = [int(n) for n in args.dask_workers.split(",") if n.strip()]
    if counts and importlib.util.find_spec("prefect_dask") is None:
        say("Dask rows skipped: prefect-dask is not installed (pip install '.[dask]')")
        return []
    rows = []
    for count in counts:

        def dask_run(attempt: int, count: int = count) -> dict[str, Any]:
            os.environ["MLSTM_HOME"] = str(run_dir / f"home-dask{count}-{attempt}")
            return run_flow(inputs, run_dir / f"store-dask{count}-{attempt}", count, runner="dask")

        def dask_after(attempt: int, details: dict[str, Any], count: int = count) -> None:
            manifest = _manifest_of(details["summary"])
            problems.extend(check_manifest(f"Dask {count} build, run {attempt + 1}", manifest, inputs))
            digests.append(shard_digests(manifest))
            details["windows"] = flow_windows(details.pop("called"))
            shutil.rmtree(run_dir / f"store-dask{count}-{attempt}")

        rows.append(
            measure(
                f"full build (flow, Dask {count} worker{'s' if count > 1 else ''})",
                dask_run,
                args.repeat,
                notes=f"MLSTM_TASK_RUNNER=dask: a temporary LocalCluster of {count} processes × 1 thread, "
                "started and stopped inside the timer",
                after=dask_after,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    return in_workdir(parse_args(argv), _benchmark, prefix="mlstm-bench-")


def _benchmark(args: argparse.Namespace, workdir: Path, run_dir: Path) -> int:
    say(f"input: {args.mb:g} MB from {args.source_dir} → {workdir / 'inputs'}")
    inputs = prepare_inputs(args, workdir)
    say(
        f"  {'reused' if inputs.reused else f'generated in {inputs.seconds:.1f} s'}: "
        f"{inputs.bytes / MB:,.1f} MB, {inputs.records:,} records, {inputs.copies} copies of each, "
        f"{len(inputs.files)} files ({inputs.skipped} source records without text left out)"
    )
    problems: list[str] = []
    digests: list[list[tuple[str, str]]] = []
    code = code_digest()
    workers = args.workers

    floor_dir = run_dir / "floor"
    floor = measure(
        "floor: pyarrow read_json → IPC",
        lambda _: run_floor(inputs, floor_dir),
        args.repeat,
        notes="C++ reader, default threads; the build's 16-field schema, other fields ignored",
        after=lambda *_: shutil.rmtree(floor_dir),
    )
    inferred = measure(
        "floor, pyarrow defaults",
        lambda _: run_floor(inputs, floor_dir, explicit_schema=False),
        args.repeat,
        notes="the same, every field inferred (nested style/image too)",
        after=lambda *_: shutil.rmtree(floor_dir),
    )
    loop = measure(
        "json.loads loop",
        lambda _: run_loads_loop(inputs),
        args.repeat,
        notes="1 process: json.loads per line, text taken, nothing written",
    )

    # The builds' modules (Prefect with them) are imported untimed, as a command would have them
    # imported before it starts; the worker processes still import them inside the timer.
    import flows.cli.corpus  # noqa: F401
    import tasks.corpus.build  # noqa: F401

    def plain_after(attempt: int, details: dict[str, Any]) -> None:
        manifest = details.pop("manifest")
        problems.extend(check_manifest(f"plain build, run {attempt + 1}", manifest, inputs))
        digests.append(shard_digests(manifest))
        shutil.rmtree(run_dir / f"store-plain-{attempt}")

    plain = measure(
        "full build (plain functions)",
        lambda attempt: run_plain(
            inputs, run_dir / f"store-plain-{attempt}", run_dir / f"cache-plain-{attempt}.json", workers
        ),
        args.repeat,
        notes=f"no Prefect: ProcessPoolExecutor({workers}, spawn)",
        after=plain_after,
    )
    plain.notes += f"; {plain.details['pieces']} pieces, {plain.details['buckets']} buckets"

    from flows.runtime import prefect_api
    from tasks.settings import get_settings

    say("starting the Prefect API and creating MLflow's database (not timed) …")
    setup = time.perf_counter()
    with prefect_api(get_settings()):
        import mlflow

        mlflow.set_tracking_uri(os.environ["MLSTM_MLFLOW_TRACKING_URI"])
        mlflow.set_experiment(get_settings().mlflow_experiment)
        setup = time.perf_counter() - setup

        def flow_run(attempt: int) -> dict[str, Any]:
            # A fresh home each time: the fingerprint cache of an earlier run must not help.
            os.environ["MLSTM_HOME"] = str(run_dir / f"home-{attempt}")
            return run_flow(inputs, run_dir / f"store-flow-{attempt}", workers)

        def flow_after(attempt: int, details: dict[str, Any]) -> None:
            manifest = _manifest_of(details["summary"])
            problems.extend(check_manifest(f"flow build, run {attempt + 1}", manifest, inputs))
            digests.append(shard_digests(manifest))
            details["windows"] = flow_windows(details.pop("called"))
            if attempt < args.repeat - 1:  # the last store stays for the second run
                shutil.rmtree(run_dir / f"store-flow-{attempt}")

        flow = measure(
            "full build (flow)",
            flow_run,
            args.repeat,
            notes=f"Prefect ProcessPoolTaskRunner({workers}); cleaning, dedupe, split, checksums, MLflow log",
            after=flow_after,
        )
        last_store = run_dir / f"store-flow-{args.repeat - 1}"
        second = measure(
            "second run (flow)",
            lambda _: run_flow(inputs, last_store, workers),
            args.repeat,
            notes="manifest already there: fingerprints from the cache, no flow run",
        )
        if second.details["summary"]["corpus_id"] != flow.details["summary"]["corpus_id"]:
            problems.append("the second run found a different corpus")
        dask_rows = measure_dask(args, inputs, run_dir, problems, digests)
    shutil.rmtree(last_store, ignore_errors=True)
    if any(d != digests[0] for d in digests):
        problems.append("the builds did not all write the same shards")
    if code_digest() != code:
        problems.append(f"the corpus code changed during the run ({', '.join(CODE_FILES)}): run it again")

    for row in (floor, inferred, loop, flow, plain, *dask_rows):
        row.mb_per_s = inputs.bytes / MB / row.seconds
        row.ratio_vs_floor = floor.seconds / row.seconds
    flow.notes += (
        f"; RSS tree without the API server {gib(flow.peaks.tree_without_api)} "
        f"(server {gib(flow.peaks.api)}; it and MLflow's database were started untimed, {setup:.1f} s)"
    )
    rows = [floor, inferred, loop, flow, plain, second, *dask_rows]
    import prefect
    import pyarrow

    info = machine(pyarrow=pyarrow.__version__, prefect=prefect.__version__)
    print_report(rows, inputs, info)

    ratio = flow.ratio_vs_floor or 0.0
    goal = {
        "ratio": ratio,
        "ratio_vs_pyarrow_defaults": inferred.seconds / flow.seconds,
        "ratio_met": ratio >= GOAL_RATIO,
        "peak_rss_tree": flow.peaks.tree,
        "rss_met": flow.peaks.tree < GOAL_RSS,
    }
    print(
        f"goal: full build (flow) ≥ {GOAL_RATIO:.0%} of the floor: {ratio:.0%} "
        f"(of the pyarrow-defaults floor: {goal['ratio_vs_pyarrow_defaults']:.0%}) "
        f"({'met' if goal['ratio_met'] else 'NOT met'}); peak RSS of the process tree < "
        f"{GOAL_RSS / 1e9:.1f} GB ({gib(int(GOAL_RSS))}): {gib(flow.peaks.tree)} "
        f"({'met' if goal['rss_met'] else 'NOT met'})"
    )
    if problems:
        for problem in problems:
            print(f"CHECK FAILED: {problem}", file=sys.stderr)
    else:
        print(
            f"checks: every build kept all {inputs.records:,} records (0 duplicates, 0 rejected) "
            "and wrote the same shards"
        )

    if args.json_path or args.record is not None:
        report = {
            "machine": info,
            "command": " ".join(["python", *sys.argv]),
            "code_digest": code,
            "code_files": list(CODE_FILES),
            "input": {
                "bytes": inputs.bytes,
                "records": inputs.records,
                "copies": inputs.copies,
                "skipped_source_records": inputs.skipped,
                "gzip": inputs.gzip,
                "files": [asdict(f) for f in inputs.files],
            },
            "rows": [asdict(row) for row in rows],
            "goal": goal,
            "checks_failed": problems,
        }
        if args.json_path:
            args.json_path.write_text(json.dumps(report, indent=2) + "\n")
        record("corpus", args.record, report)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
