#!/usr/bin/env python
"""A corpus grown by a delta against a full build of the same files, and the fixed cost of a build
with little to do, measured in one run.

Growth: the input of ``benchmarks/corpus.py`` (the shared Amazon files, every record repeated with a
unique tag) is cut line-aligned into a base holding the first ~95% of each file's bytes and a delta
of new files holding the rest (``week2_<name>``). Rows, each with the stage functions in a spawn
process pool as ``corpus.py``'s plain row (no Prefect), the fingerprint cache warm for every row:

- full build: every file, base and delta;
- base build: the base's files alone (the corpus last week);
- delta build: ``--base`` on that corpus with every file given, parsing the delta's files only.

Checks: the grown corpus holds the full build's rows per split (row counts and the sorted XXH3-128
keys of the texts; ``tests/test_corpus_delta.py`` compares every column on small files).

Fixed cost: one small file (Appliances_5.json.gz, 73 KB) built as ``corpus build`` builds it, the
temporary Prefect API included, with a process pool (as before) and a thread pool (what
``corpus build`` now picks for a single piece), beside the plain functions in this process and the
temporary API started and stopped alone.

    .venv/bin/python benchmarks/corpus_delta.py --mb 1000 --record
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common import add_record_option, fastest_of, machine, new_parser, record, say
from corpus_input import DEFAULT_SOURCE_DIR, InputSet, prepare_inputs  # corpus.py's input
from corpus_measure import Row, in_workdir, measure  # corpus.py's sampler and measure

GOAL_RATIO = 0.10  # the delta build within 10% of the full build's time
DELTA_SHARE = 0.05


def split_inputs(inputs: InputSet, folder: Path) -> tuple[list[Path], list[Path]]:
    """Each input file cut at ~95% of its bytes, on a line end: the base's part keeps the file's
    name, the rest becomes a new file ``week2_<name>``."""
    base_dir, delta_dir = folder / "base", folder / "delta"
    for directory in (base_dir, delta_dir):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    base, delta = [], []
    for spec in inputs.files:
        path = Path(spec.path)
        data = path.read_bytes()
        cut = data.index(b"\n", int(len(data) * (1 - DELTA_SHARE))) + 1
        (base_dir / path.name).write_bytes(data[:cut])
        (delta_dir / f"week2_{path.name}").write_bytes(data[cut:])
        base.append(base_dir / path.name)
        delta.append(delta_dir / f"week2_{path.name}")
    return base, delta


def run_plan(plan: Any, store_dir: Path, workers: int) -> dict[str, Any]:
    """A plan's pieces and buckets in a spawn process pool, then its manifest (corpus.py's plain row)."""
    from tasks.corpus.build import bucket_inputs, build_manifest, parse_piece, publish_manifest, reduce_bucket
    from tasks.corpus.lock import building
    from tasks.store import open_store

    store = open_store(str(store_dir))
    context = multiprocessing.get_context("spawn")
    with building(store, plan.prefix, plan.corpus_id, grows=plan.base_prefix):
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            sent = plan.for_tasks()
            pieces = list(pool.map(parse_piece, *zip(*[(sent, p, store) for p in plan.pieces], strict=True)))
            inputs = bucket_inputs(pieces, plan.num_buckets)
            reduce_args = [(sent, b, store, inputs[b]) for b in range(plan.num_buckets)]
            buckets = list(pool.map(reduce_bucket, *zip(*reduce_args, strict=True)))
        manifest = build_manifest(plan, store, pieces, buckets)
        publish_manifest(plan, store, manifest)
    return {"manifest": manifest, "pieces": len(plan.pieces), "buckets": plan.num_buckets}


def split_keys(store_dir: Path, manifest: Any) -> dict[str, tuple[int, Any]]:
    """Per split: rows, and the sorted keys of their texts."""
    import numpy as np
    import pyarrow as pa

    from tasks.corpus.keys import text_keys
    from tasks.corpus.manifest import shard_key

    found = {}
    for split in manifest.splits:
        keys = []
        for shard in manifest.shards(split):
            path = store_dir / shard_key(f"corpora/{manifest.corpus_id}/manifest.json", shard.path)
            text = pa.ipc.open_file(pa.memory_map(str(path))).read_all()["text"]
            hi, lo = text_keys(text.combine_chunks())
            keys.append(np.stack([hi, lo], axis=1))
        joined = np.concatenate(keys) if keys else np.zeros((0, 2), np.uint64)
        found[split] = (len(joined), joined[np.lexsort((joined[:, 1], joined[:, 0]))])
    return found


def fixed_cost(source: Path, run_dir: Path, repeat: int) -> list[dict[str, Any]]:
    """One small file, built as ``corpus build`` does, with each task runner, beside the plain functions."""
    from flows.corpus import build_corpus
    from flows.runtime import prefect_api
    from flows.runtime import task_runner as make_task_runner
    from tasks.corpus.build import CorpusConfig, build_in_process, plan_corpus
    from tasks.settings import get_settings
    from tasks.store import LocalStore

    def flow_build(runner: str) -> None:
        store = run_dir / f"small-{runner}-{time.monotonic_ns()}"
        settings = get_settings(store_uri=str(store), task_runner=runner)  # type: ignore[arg-type]
        flow = build_corpus.with_options(task_runner=make_task_runner(settings))
        with prefect_api(settings):
            flow(sources=[str(source)], store=settings.resolved_store_uri, config=CorpusConfig())

    def api_alone() -> None:
        with prefect_api(get_settings()):
            pass

    def plain() -> None:
        store = LocalStore(run_dir / f"small-plain-{time.monotonic_ns()}")
        build_in_process(plan_corpus([str(source)], CorpusConfig()), store)

    cases = [
        ("flow, process pool (before)", lambda: flow_build("process")),
        ("flow, thread pool (now, one piece)", lambda: flow_build("thread")),
        ("temporary Prefect API alone", api_alone),
        ("plain functions in this process", plain),
    ]
    return [fastest_of(name, case, repeat) for name, case in cases]


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--mb", type=float, default=1000, help="Input size in MB (10**6 bytes), all files.")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeat", type=int, default=1, help="Runs of each row; the fastest is kept.")
    parser.add_argument("--fixed-repeat", type=int, default=2, help="Runs of each fixed-cost case.")
    parser.add_argument("--source-dir", type=Path, default=DEFAULT_SOURCE_DIR)
    parser.add_argument("--workdir", type=Path, help="Keep the generated input here between runs.")
    add_record_option(parser)
    args = parser.parse_args(argv)
    args.partial, args.gzip = True, False  # corpus.py's input: every file, plain JSON lines
    return in_workdir(args, _benchmark, prefix="mlstm-delta-")


def _benchmark(args: Any, workdir: Path, run_dir: Path) -> int:
    from tasks.corpus.build import CorpusConfig, plan_corpus
    from tasks.corpus.delta import plan_build
    from tasks.store import LocalStore

    inputs = prepare_inputs(args, workdir)
    base_files, delta_files = split_inputs(inputs, run_dir / "inputs")
    sizes = {
        "base": sum(p.stat().st_size for p in base_files),
        "delta": sum(p.stat().st_size for p in delta_files),
    }
    say(
        f"input: {sizes['base'] / 1e6:,.1f} MB base + {sizes['delta'] / 1e6:,.1f} MB delta in {len(base_files)} + {len(delta_files)} files"
    )
    cache = run_dir / "fingerprints.json"
    every = [str(p) for p in [*base_files, *delta_files]]
    config = CorpusConfig()
    plan_corpus(every, config, cache_path=cache)  # the fingerprint cache warm for every row
    rows: list[Row] = []
    stores = {name: run_dir / f"store-{name}" for name in ("full", "grown")}

    def fresh(name: str) -> None:
        shutil.rmtree(stores[name], ignore_errors=True)

    full = measure(
        "full build (all files)",
        lambda attempt: (
            fresh("full"),
            run_plan(plan_corpus(every, config, cache_path=cache), stores["full"], args.workers),
        )[1],
        args.repeat,
        notes="every file parsed, deduplicated and written",
    )
    rows.append(full)
    base = measure(
        "base build (95%)",
        lambda attempt: (
            fresh("grown"),
            run_plan(
                plan_corpus([str(p) for p in base_files], config, cache_path=cache),
                stores["grown"],
                args.workers,
            ),
        )[1],
        1,
        notes="the corpus before the delta",
    )
    rows.append(base)
    base_uri = str(stores["grown"] / "corpora" / base.details["manifest"].corpus_id / "manifest.json")
    grown_store = LocalStore(stores["grown"])

    def delta_run(attempt: int) -> dict[str, Any]:
        plan = plan_build(every, config.model_copy(update={"base": base_uri}), grown_store, cache_path=cache)
        shutil.rmtree(stores["grown"] / plan.prefix, ignore_errors=True)
        return run_plan(plan, stores["grown"], args.workers)

    delta = measure(
        "delta build (--base)",
        delta_run,
        args.repeat,
        notes="the new files parsed, deduplicated against the base's key index",
    )
    rows.append(delta)

    grown, reference = delta.details["manifest"], full.details["manifest"]
    ours, theirs = split_keys(stores["grown"], grown), split_keys(stores["full"], reference)
    problems = []
    for split in theirs:
        if ours[split][0] != theirs[split][0] or not (ours[split][1] == theirs[split][1]).all():
            problems.append(
                f"split {split}: {ours[split][0]:,} rows grown, {theirs[split][0]:,} in the full build"
            )
    fixed = fixed_cost(args.source_dir / "Appliances_5.json.gz", run_dir, args.fixed_repeat)

    ratio = delta.seconds / full.seconds
    peak_ratio = delta.peaks.tree / max(full.peaks.tree, 1)
    results = {
        "input": {
            "mb": args.mb,
            "base_bytes": sizes["base"],
            "delta_bytes": sizes["delta"],
            "files": len(base_files) + len(delta_files),
        },
        "rows": [
            {
                "name": row.name,
                "seconds": round(row.seconds, 2),
                "runs": row.runs,
                "peak_rss_tree": row.peaks.tree,
                "pieces": row.details["pieces"],
                "buckets": row.details["buckets"],
                "notes": row.notes,
            }
            for row in rows
        ],
        "rows_kept": {"grown": grown.totals.kept, "full": reference.totals.kept},
        "delta_rows": grown.delta.totals.kept if grown.delta else 0,
        "goal": {
            "delta_vs_full_time": round(ratio, 3),
            "time_goal": GOAL_RATIO,
            "delta_vs_full_peak_rss": round(peak_ratio, 3),
            "met": ratio <= GOAL_RATIO and peak_ratio <= 1.0 and not problems,
        },
        "fixed_cost": fixed,
        "checks_failed": problems,
        "machine": machine(),
    }
    for row in rows:
        say(f"{row.name}: {row.seconds:.2f} s, peak RSS {row.peaks.tree / 2**30:.2f} GiB")
    say(
        f"delta / full: {ratio:.3f} of the time, {peak_ratio:.2f} of the peak RSS; rows equal: {not problems}"
    )
    for case in fixed:
        say(f"fixed cost: {case['name']}: {case['seconds']:.2f} s")
    record("corpus_delta", args.record, results)
    for problem in problems:
        say(f"CHECK FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
