"""``mlstm-sentiment corpus …``: build, inspect and sample review corpora."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from flows.cli.common import (
    RichSink,
    StoreOption,
    fail,
    options_from,
    out,
    parsed,
    progress_bar,
    styled,
    user_errors,
)
from tasks.corpus.config import CorpusConfig
from tasks.settings import TaskRunnerName, WorkerOptions, get_settings

if TYPE_CHECKING:
    from tasks.corpus.manifest import Manifest
    from tasks.corpus.result import CorpusResult


app = typer.Typer(help="Build and inspect review corpora (Arrow shards + manifest).", no_args_is_help=True)


def run_corpus_build(
    sources: list[str],
    *,
    store: str | None,
    config: CorpusConfig,
    task_runner: TaskRunnerName | None = None,
    workers: int | None = None,
    show_progress: bool = True,
    create_bucket: bool = False,
) -> CorpusResult:
    """Build a corpus as a Prefect flow run, or return at once if it is already built."""
    from flows import progress
    from flows.cli.interrupts import stoppable
    from flows.corpus import build_corpus
    from flows.runtime import prefect_api, runner_for
    from flows.runtime import task_runner as make_task_runner
    from tasks.corpus.delta import plan_build
    from tasks.corpus.manifest import read_manifest
    from tasks.corpus.result import CorpusResult
    from tasks.corpus.sources import expand_sources
    from tasks.secrets import hide
    from tasks.store import store_of

    settings = get_settings(store_uri=store, task_runner=task_runner, max_workers=workers)
    sources = [hide(source) for source in sources]  # credentials reach the fetch, not the flow run's records
    target = store_of(settings)
    # A store that cannot be written fails now, not after every source is parsed.
    target.check_writable(create_bucket=create_bucket)
    if any(s.startswith(("s3://", "http://", "https://")) for s in sources):
        # A missing source is an error before any flow run, remote ones included.
        expand_sources(sources, s3_endpoint_url=settings.s3_endpoint_url)
    else:
        # Local sources are cheap to fingerprint again: a corpus already built needs no flow run.
        plan = plan_build(sources, config, target, cache_path=settings.home / "cache" / "fingerprints.json")
        if target.exists(plan.manifest_key):
            manifest = read_manifest(target, plan.manifest_key)
            return CorpusResult.of(manifest, target.url(plan.manifest_key), plan.full_build_reason)
        settings = runner_for(settings, len(plan.pieces))
    flow = build_corpus.with_options(task_runner=make_task_runner(settings))
    bar = progress_bar(show=show_progress)
    with stoppable(), prefect_api(settings), bar, progress.reporting_to(RichSink(bar)):
        return flow(sources=sources, store=settings.resolved_store_uri, config=config)


# The build's settings as flags: each is declared once, in tasks/corpus/config.py (the build's) and
# tasks/settings.py (the workers', shared with `score`).
SETTINGS = ("split", "shard_mb", "bucket_mb", "piece_mb", "base", "fallback")
WORKER_SETTINGS = tuple(WorkerOptions.model_fields)


@app.command("build")
@options_from(CorpusConfig, SETTINGS)
@options_from(WorkerOptions, WORKER_SETTINGS)
def corpus_build(
    sources: Annotated[
        list[str], typer.Argument(help="Files, folders, globs, s3:// prefixes or http(s):// URLs.")
    ],
    store: StoreOption = None,
    create_bucket: Annotated[
        bool, typer.Option("--create-bucket", help="Create the store's S3 bucket if it does not exist.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    **settings: Any,
) -> None:
    """Shard raw Amazon reviews (2014/2018/2023 formats) into deduplicated Arrow files with a manifest."""
    config = parsed(CorpusConfig, {name: settings[name] for name in SETTINGS})
    workers = parsed(WorkerOptions, {name: settings[name] for name in WORKER_SETTINGS})
    try:
        summary = run_corpus_build(
            sources,
            store=store,
            config=config,
            task_runner=workers.task_runner,
            workers=workers.workers,
            create_bucket=create_bucket,
        )
    except user_errors() as error:
        raise fail(error) from None
    if as_json:
        print(json.dumps(summary.model_dump(mode="json")))
        return
    out.print(
        styled(f"corpus {summary.corpus_id}", "bold green"),
        f": {summary.rows:,} rows, {summary.duplicates:,} duplicates removed, {summary.rejected:,} rejected",
        sep="",
    )
    out.print(f"manifest: {summary.manifest_uri}", highlight=False)
    if summary.full_build_reason:
        out.print(f"built in full: {summary.full_build_reason}", highlight=False)


def _load_manifest(uri: str) -> Manifest:
    """The manifest at ``uri`` (or in the corpus folder ``uri``), or one line saying what is wrong."""
    from tasks.corpus.manifest import load_manifest

    try:
        return load_manifest(uri, endpoint_url=get_settings().s3_endpoint_url)[2]
    except user_errors(OSError) as error:
        raise fail(error) from None


ManifestArgument = Annotated[
    str, typer.Argument(help="URI of a corpus manifest.json (or the corpus folder holding it).")
]


@app.command("show")
def corpus_show(manifest_uri: ManifestArgument) -> None:
    """Print a corpus's splits and per-source counts."""
    manifest = _load_manifest(manifest_uri)
    splits = Table(title=f"corpus {manifest.corpus_id} · cleaning {manifest.cleaning.name}")
    for column in ("split", "rows", "text MiB", "shards"):
        splits.add_column(column, justify="right")
    for name, info in manifest.splits.items():
        splits.add_row(name, f"{info.rows:,}", f"{info.text_bytes / 2**20:,.1f}", str(len(info.shards)))
    out.print(splits)
    sources = Table(title="sources")
    for column in ("source", "records", "kept", "duplicates", "rejected"):
        sources.add_column(column, justify="left" if column == "source" else "right")
    for s in manifest.sources:
        sources.add_row(s.name, *(f"{n:,}" for n in (s.records, s.kept, s.duplicates, s.rejected)))
    out.print(sources)
    out.print(f"rejected records: {manifest.rejected_uri}", highlight=False)
    if manifest.parent is not None and manifest.delta is not None:
        out.print(
            f"delta of {manifest.delta.totals.kept:,} rows on corpus {manifest.parent.corpus_id} "
            f"({', '.join(manifest.delta.sources)})",
            highlight=False,
        )


@app.command("rejected")
def corpus_rejected(
    manifest_uri: ManifestArgument,
    limit: Annotated[int, typer.Option(min=0, help="Show at most this many.")] = 20,
) -> None:
    """List rejected records: source, line, reason and the start of the raw line."""
    import pyarrow as pa

    from tasks.store import split_object_uri

    manifest = _load_manifest(manifest_uri)
    settings = get_settings()
    table = Table(title=f"rejected records of corpus {manifest.corpus_id}")
    for column in ("source", "line", "reason", "raw"):
        table.add_column(column, overflow="fold")
    shown = 0
    for uri in manifest.rejected_files:
        store, key = split_object_uri(uri, endpoint_url=settings.s3_endpoint_url)
        rows = pa.ipc.open_file(pa.py_buffer(store.read_bytes(key))).read_all().to_pylist()
        for row in rows[: limit - shown]:
            raw = row["raw"][:80].decode("utf-8", "backslashreplace")
            table.add_row(row["source"].rpartition("/")[2], str(row["line"]), row["reason"], raw)
            shown += 1
    out.print(table)
    out.print(f"{manifest.totals.rejected:,} rejected in all")


@app.command("sample")
def corpus_sample(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the sample files into.")],
    reviews: Annotated[int, typer.Option(min=30, max=10_000_000, help="About how many reviews.")] = 3000,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same bytes).")] = 0,
) -> None:
    """Generate a small review sample in the real Amazon 2014, 2018 and 2023 formats."""
    from tasks.corpus.sample import write_sample

    if out_dir.exists() and not out_dir.is_dir():
        raise fail(f"{out_dir} is a file: give a folder to write the sample into")
    for path in write_sample(out_dir, num_reviews=reviews, seed=seed):
        out.print(str(path), highlight=False)
