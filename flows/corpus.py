"""The corpus flow: raw review files → deduplicated Arrow shards and a manifest in the store."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import get_run_context
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner

from flows import names, progress
from flows.runtime import check_cluster, retry_unless
from flows.stopping import Stopped, stop_if_told, stop_threads_on_error
from tasks.corpus.build import (
    BucketResult,
    CorpusConfig,
    CorpusPlan,
    bucket_inputs,
    build_manifest,
    parse_piece,
    publish_manifest,
    reduce_bucket,
)
from tasks.corpus.delta import DeltaRefused, plan_build
from tasks.corpus.lock import BuildLock, building
from tasks.corpus.manifest import Manifest, read_manifest
from tasks.corpus.result import CorpusResult
from tasks.corpus.sources import SourceError
from tasks.corpus.tracking import log_corpus
from tasks.secrets import hide
from tasks.settings import Settings, get_settings
from tasks.store import Store, store_of
from tasks.tracking import experiment_id, run_link

# Prefect tasks: the plain work of tasks.corpus.build, with retries for what is worth retrying
# (I/O; bad records never raise, they are rejected).


# A missing or unreadable SOURCE stays so; network and store errors may pass.
_worth_retrying = retry_unless(SourceError, DeltaRefused)
plan_corpus_task = task(
    name="plan corpus", retries=2, retry_delay_seconds=5, retry_condition_fn=_worth_retrying
)(plan_build)
parse_piece_task = task(
    name="parse piece",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless(Stopped),
    task_run_name="parse {piece.piece_id}",
)(parse_piece)


def reduce_unless_stopped(
    plan: CorpusPlan, bucket: int, store: Store, piece_ids: tuple[str, ...]
) -> BucketResult:
    """``reduce_bucket``, unless the flow has stopped (``flows.stopping``): a build on threads then stops
    at its next bucket, and the buckets not yet begun leave nothing for the rerun to trust."""
    stop_if_told()
    return reduce_bucket(plan, bucket, store, piece_ids)


reduce_bucket_task = task(
    name="reduce bucket",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless(Stopped),
    task_run_name="reduce bucket {bucket}",
)(reduce_unless_stopped)


# Pieces run in worker processes by default (the CLI picks the runner from the settings).
@flow(
    name="build_corpus",
    flow_run_name=names.corpus_name,
    log_prints=True,
    task_runner=ProcessPoolTaskRunner(),  # type: ignore[arg-type]  # Prefect's annotation is narrower than its runners
)
def build_corpus(
    sources: list[str],
    store: str | None = None,
    config: CorpusConfig | None = None,
    force: bool = False,
    parent_run_id: str | None = None,
) -> CorpusResult:
    """Build (or find) the corpus of ``sources`` in ``store``; its result (what --json prints).

    Args:
        sources: Files, folders, globs, s3:// prefixes or http(s):// URLs of raw reviews.
        store: Store URI (folder or s3://bucket/prefix); default from the settings.
        config: Split proportions, shard size and the work sizes.
        force: Build and publish again even when this corpus is already built (same bytes).
        parent_run_id: MLflow run (a pipeline's) that the corpus run is a child of.
    """
    settings = get_settings(store_uri=store)
    config = config or CorpusConfig()
    sources = [hide(source) for source in sources]  # a deployment's parameters may hold credentials
    logger = get_run_logger()
    started = time.perf_counter()
    target = store_of(settings)
    target.check_writable()  # before any source is read
    check_cluster(target, get_run_context().task_runner)  # type: ignore[union-attr]
    plan = plan_corpus_task(
        sources,
        config,
        target,
        s3_endpoint_url=settings.s3_endpoint_url,
        cache_path=settings.home / "cache" / "fingerprints.json",
    )
    if plan.full_build_reason:  # config.base could not be grown, and config.fallback asked for this
        logger.warning("%s", plan.full_build_reason)
    with building(
        target, plan.prefix, plan.corpus_id, grows=plan.base_prefix
    ) as lock:  # one build of a corpus at a time
        if target.exists(plan.manifest_key) and not force:
            target.delete_prefix(plan.work_key())  # what a build killed as it published left
            logger.info("corpus %s is already built: %s", plan.corpus_id, target.url(plan.manifest_key))
            manifest = read_manifest(target, plan.manifest_key)
            return CorpusResult.of(manifest, target.url(plan.manifest_key), plan.full_build_reason)
        return _build(plan, target, settings, lock, started, parent_run_id)


def _build(
    plan: CorpusPlan,
    target: Store,
    settings: Settings,
    lock: BuildLock,
    started: float,
    parent_run_id: str | None,
) -> CorpusResult:
    """Parse every piece, reduce every bucket, publish: the build itself, under its lock."""
    logger = get_run_logger()
    logger.info(
        "corpus %s: %d sources, %d pieces, %d buckets%s",
        plan.corpus_id,
        len(plan.sources),
        len(plan.pieces),
        plan.num_buckets,
        f" (a delta on corpus {plan.base.corpus_id})" if plan.base else "",
    )

    sink = progress.current()
    sink.stage("parse", total=sum(p.estimated_bytes for p in plan.pieces))
    sizes = {p.piece_id: p.estimated_bytes for p in plan.pieces}
    pieces = []
    # Each task is sent the plan without its pieces, and its own piece (CorpusPlan.for_tasks says why).
    sent = plan.for_tasks()
    # A piece on a thread of this process (a build of one piece) stops at its next block with the flow.
    futures = parse_piece_task.map(
        sent, list(plan.pieces), target, s3_endpoint_url=settings.s3_endpoint_url, on_block=stop_if_told
    )
    with stop_threads_on_error():
        for future in as_completed(futures):
            result = future.result()
            pieces.append(result)
            sink.advance(sizes[result.piece_id])
            lock.refresh()

    sink.stage("dedupe + write shards", total=plan.num_buckets)
    buckets: list[BucketResult] = []
    inputs = bucket_inputs(pieces, plan.num_buckets)  # each bucket's task, the pieces that wrote it
    reduced = reduce_bucket_task.map(sent, list(range(plan.num_buckets)), target, inputs)
    with stop_threads_on_error():
        for reduced_future in as_completed(reduced):
            buckets.append(reduced_future.result())
            sink.advance(1)
            lock.refresh()

    manifest = build_manifest(plan, target, pieces, buckets)
    manifest_uri = publish_manifest(plan, target, manifest)
    seconds = time.perf_counter() - started
    tags = {"prefect_flow_run_id": str(get_run_context().flow_run.id)}  # type: ignore[union-attr]
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run_id = log_corpus(settings, manifest, manifest_uri, seconds, tags)
    mlflow_run = run_link(settings, experiment_id(settings), run_id)
    _publish_artifacts(manifest, manifest_uri, mlflow_run, plan.full_build_reason)
    logger.info("corpus %s published: %s (%.1f s)", plan.corpus_id, manifest_uri, seconds)
    return CorpusResult.of(manifest, manifest_uri, plan.full_build_reason)


def _publish_artifacts(
    manifest: Manifest, manifest_uri: str, mlflow_run: str, full_build_reason: str | None
) -> None:
    """What a user sees on the flow run's page in the Prefect UI."""
    rows = [
        {
            "source": s.name,
            "category": s.category,
            "records": s.records,
            "kept": s.kept,
            "duplicates": s.duplicates,
            "rejected": s.rejected,
        }
        for s in manifest.sources
    ]
    create_table_artifact(key="corpus-sources", table=rows, description="Records per source")
    totals = manifest.totals
    splits = " · ".join(f"{name}: {info.rows:,} rows" for name, info in manifest.splits.items())
    create_markdown_artifact(
        key="corpus-manifest",
        markdown=(
            f"### Corpus `{manifest.corpus_id}`\n\n"
            f"- manifest: [{manifest_uri}]({manifest_uri})\n"
            f"- {splits}\n"
            f"- {totals.records:,} records: {totals.kept:,} kept, "
            f"{totals.duplicates:,} duplicates, {totals.rejected:,} rejected "
            f"(kept under `{manifest.rejected_uri}`)\n"
            f"- MLflow run: {mlflow_run}\n"
            + _delta_line(manifest)
            + (f"- built in full: {full_build_reason}\n" if full_build_reason else "")
        ),
        description="The published corpus",
    )


def _delta_line(manifest: Manifest) -> str:
    """A grown corpus says what it added to which corpus."""
    if manifest.delta is None or manifest.parent is None:
        return ""
    return (
        f"- delta of {manifest.delta.totals.kept:,} rows on corpus `{manifest.parent.corpus_id}` "
        f"(from {', '.join(manifest.delta.sources)})\n"
    )
