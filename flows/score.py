"""The score flow: a table of reviews → the registered classifier's scores as Parquet, piece by piece."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner

from flows import names, progress
from flows.runtime import retry_unless
from flows.stopping import Stopped, stop_if_told, stop_threads_on_error
from tasks.corpus.build import cpu_count
from tasks.score.config import PIECE_ROWS
from tasks.score.inputs import InputError, InputFile
from tasks.score.result import ScoreResult
from tasks.score.scoring import (
    Piece,
    Plan,
    build_manifest,
    describe_inputs,
    load_described,
    plan_scoring,
    publish_manifest,
    read_manifest,
    score_piece,
)
from tasks.score.tracking import log_scoring, resolve_model
from tasks.settings import get_settings
from tasks.tracking import experiment_id, run_link

# A bad input file stays bad; a store or network error may pass.
_worth_retrying = retry_unless(InputError, ValueError, Stopped)
PROGRESS_SECONDS = 2.0  # between updates of a piece's progress artifact
# Rows each piece's batches have told this process's progress sink, by (scoring id, piece): only a piece
# on a thread of this process adds here; the flow tells the sink the rest of a piece once it is done.
_TOLD: dict[tuple[str, int], int] = {}


class _ProgressArtifact:
    """A progress artifact on the flow run's page: ``amount`` done of ``total`` (told by ``of`` once it is
    known; 1 before). An update is an API call (about 30 ms here): at most one a PROGRESS_SECONDS, not
    one a batch, but the last."""

    def __init__(self, key: str, description: str) -> None:
        self.id = create_progress_artifact(progress=0.0, key=key, description=description)
        self.shown = time.monotonic()
        self.total, self.amount = 1.0, 0.0

    def of(self, total: float) -> None:
        self.total = max(total, 1)

    def advance(self, amount: float) -> None:
        self.amount += amount
        if time.monotonic() - self.shown >= PROGRESS_SECONDS:
            self.shown = time.monotonic()
            update_progress_artifact(self.id, progress=100 * self.amount / self.total)  # type: ignore[arg-type]  # sync: a UUID

    def done(self) -> None:
        update_progress_artifact(self.id, progress=100.0)  # type: ignore[arg-type]


@task(
    name="describe inputs",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_worth_retrying,
    cache_policy=NO_CACHE,
)
def describe_inputs_task(
    inputs: list[str],
    *,
    text_column: str,
    id_columns: list[str] | None,
    s3_endpoint_url: str | None,
    output: str,
) -> tuple[InputFile, ...]:
    """The inputs described where no caller did (a deployment's run), with a progress artifact: hashing,
    scanning and parsing a 40 GB input take minutes."""
    artifact = _ProgressArtifact("score-describe", "Inputs hashed, scanned for row offsets and parsed")
    files = describe_inputs(
        inputs,
        text_column=text_column,
        id_columns=id_columns,
        s3_endpoint_url=s3_endpoint_url,
        output=output,
        on_start=artifact.of,
        on_progress=artifact.advance,
    )
    artifact.done()
    return files


@task(
    name="score piece",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_worth_retrying,
    cache_policy=NO_CACHE,
    task_run_name="score piece {piece.index}",
)
def score_piece_task(
    plan: Plan, piece: Piece, threads: int | None = None, workers: int = 1, memory_budget: int | None = None
) -> dict[str, Any]:
    """One piece, with a progress artifact of its rows on the flow run's page."""
    artifact = _ProgressArtifact(
        f"score-piece-{piece.index:05d}",
        f"{piece.file.name}: part {piece.part + 1} of {piece.parts} of rows {piece.start}–{piece.stop} "
        "by length: rows scored",
    )
    sink, key = progress.current(), (plan.scoring_id, piece.index)

    def on_batch(rows: int, _bytes: int) -> None:
        stop_if_told()
        artifact.advance(rows)
        # On a thread of the command (a run of one piece) its bar moves by batch; a pool's worker has
        # no bar, and the flow moves it by piece (``_TOLD``).
        sink.advance(rows)
        _TOLD[key] = _TOLD.get(key, 0) + rows

    record = score_piece(
        plan,
        piece,
        threads=threads,
        workers=workers,
        memory_budget=memory_budget,
        on_rows=artifact.of,
        on_batch=on_batch,
    )
    artifact.done()
    return record


@flow(
    name="score",
    flow_run_name=names.score_name,
    log_prints=True,
    task_runner=ProcessPoolTaskRunner(),  # type: ignore[arg-type]  # Prefect's annotation is narrower than its runners
)
def score(
    inputs: list[str],
    output: str,
    model: str | None = None,
    text_column: str = "text",
    id_columns: list[str] | None = None,
    piece_rows: int = PIECE_ROWS,
    threads_per_worker: int | None = None,
    described: str | None = None,
    workers: int | None = None,
    precision: str = "auto",
) -> ScoreResult:
    """Score every row of ``inputs`` with a registered classifier; its result (what --json prints).

    Args:
        inputs: CSV, JSON-lines (gzip too), Parquet or Arrow IPC files, folders, globs or s3:// prefixes.
        output: Folder or s3://bucket/prefix; the run writes under OUTPUT/<scoring id>/.
        model: models:/NAME@ALIAS or models:/NAME/VERSION. Default: the settings' model @champion.
        text_column: The column (JSON field) holding the review.
        id_columns: Columns copied to the output beside each row's scores.
        piece_rows: Rows per piece on average: the unit of parallel work and of resuming.
        threads_per_worker: torch threads of each worker. Default: the cores shared by the workers, one
            for a small model (``tasks.jobs.threads``).
        described: A JSON file of ``inputs`` as ``describe_inputs`` found them (``save_described``),
            where the caller described them before the run (the CLI does, to refuse a bad file before
            Prefect starts); described here when not given. A file, not the list: a flow run's
            parameters are limited to 512 KB, and a large input's row offsets are more.
        workers: The task runner's workers, among which the cores and the memory for feature batches
            (MLSTM_SCORE_MEMORY_MIB) are shared. Default: MLSTM_MAX_WORKERS, else the CPU count.
        precision: A probe's features' dtype: auto (bf16 or fp16 on a GPU, fp32 on a CPU), bf16 (on CPUs
            with AVX-512 BF16 or AMX about 3x fp32's speed at 1,024 units and more, slower at 64),
            fp16 or fp32. Part of the scoring id where it is not auto. A fine-tuned classifier reads
            in fp32 on a CPU whatever it says.
    """
    settings = get_settings()
    logger = get_run_logger()
    started = time.perf_counter()
    if described is not None:
        files = list(load_described(described))
    else:
        files = list(
            describe_inputs_task(
                inputs,
                text_column=text_column,
                id_columns=id_columns,
                s3_endpoint_url=settings.s3_endpoint_url,
                output=output,
            )
        )
    model_ref = resolve_model(model, settings)
    plan = plan_scoring(
        tuple(files),
        output,
        model_ref,
        text_column=text_column,
        id_columns=id_columns,
        piece_rows=piece_rows,
        precision=precision,
        s3_endpoint_url=settings.s3_endpoint_url,
    )
    plan.store().check_writable(create_bucket=False, setting="--output")
    if (manifest := read_manifest(plan)) is not None:
        logger.info("already scored by %s v%d: %s", model_ref.name, model_ref.version, plan.output)
        return ScoreResult.of(manifest, plan.store().url("manifest.json"), scored=0, skipped=len(plan.pieces))
    logger.info(
        "%d rows of %d files in %d pieces, %s v%d → %s",
        sum(f.rows for f in plan.files),
        len(plan.files),
        len(plan.pieces),
        model_ref.name,
        model_ref.version,
        plan.output,
    )
    # The cores and the batch memory are shared by the pieces that run at once: one piece takes them all.
    workers = min(workers or settings.max_workers or cpu_count(), len(plan.pieces))
    sink = progress.current()
    sink.stage("score", total=sum(f.rows for f in plan.files))
    records = []
    # The run's memory for feature batches is shared by its workers: a worker's batches take 1/workers.
    pieces = score_piece_task.map(
        plan.for_pieces(),
        list(plan.pieces),
        threads=threads_per_worker,
        workers=workers,
        memory_budget=settings.score_memory_mib * 2**20,
    )
    with stop_threads_on_error():  # a piece on a thread of this process stops with the flow
        for future in as_completed(pieces):
            record = future.result()
            records.append(record)
            sink.advance(record["rows_in"] - _TOLD.pop((plan.scoring_id, record["piece"]), 0))
    manifest = build_manifest(plan, records, seconds=time.perf_counter() - started)
    scored = manifest["pieces"]["scored"]
    manifest_uri = publish_manifest(plan, manifest)
    tags = {"prefect_flow_run_id": str(get_run_context().flow_run.id)}  # type: ignore[union-attr]
    run_id = log_scoring(settings, manifest, manifest_uri, tags)
    create_markdown_artifact(
        key="score-manifest",
        markdown=(
            f"### Scored with `{model_ref.uri}` (v{model_ref.version})\n\n"
            f"- output: [{plan.output}]({plan.output}), manifest [{manifest_uri}]({manifest_uri})\n"
            f"- {manifest['rows_in']:,} rows in, {manifest['rows_out']:,} scored, "
            f"{manifest['rejected']['rows']:,} rejected (under `rejected/`)\n"
            f"- labels: {', '.join(f'{k} {v:,}' for k, v in manifest['labels'].items())}\n"
            f"- pieces: {scored} scored, {len(records) - scored} skipped (done before)\n"
            f"- MLflow run: {run_link(settings, experiment_id(settings), run_id)}\n"
        ),
        description="The published scores",
    )
    logger.info("scored %s: %s", plan.scoring_id, manifest_uri)
    return ScoreResult.of(manifest, manifest_uri, scored=scored, skipped=len(records) - scored)
