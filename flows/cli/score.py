"""``mlstm-sentiment score``: score a whole table of reviews with a registered classifier."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import RichSink, fail, options_from, out, parsed, progress_bar, styled, user_errors
from tasks.score.config import PIECE_ROWS, ScoreParams
from tasks.settings import WorkerOptions, get_settings

if TYPE_CHECKING:
    from tasks.score.result import ScoreResult

app = typer.Typer()
PANEL = "Transfer"


def run_score(
    inputs: list[str],
    *,
    output: str,
    model: str | None = None,
    text_column: str = "text",
    id_columns: list[str] | None = None,
    piece_rows: int | None = None,
    task_runner: str | None = None,
    workers: int | None = None,
    precision: str = "auto",
    show_progress: bool = True,
) -> ScoreResult:
    """The score flow run here, on the task runner the settings name (the corpus stage's).

    The inputs are described (found, hashed, counted) first, before Prefect starts: a bad file is one
    error naming it, not a failed task run's log lines in front of it, and it costs no API start.
    """
    from tasks.score.scoring import describe_inputs, save_described

    settings = get_settings(task_runner=task_runner, max_workers=workers)
    # Hashing and counting a 40 GB file takes minutes; the bar goes when done (or failed: the error alone).
    with progress_bar(show=show_progress, transient=True) as describing:
        sink = RichSink(describing)
        files = describe_inputs(
            inputs,
            text_column=text_column,
            id_columns=id_columns,
            s3_endpoint_url=settings.s3_endpoint_url,
            output=output,
            on_start=lambda count: sink.stage(f"describe {count} input{'s' * (count != 1)}", total=count),
            on_progress=sink.advance,
        )
    from flows import progress
    from flows.cli.interrupts import stoppable
    from flows.runtime import local_dask_workers, prefect_api, runner_for
    from flows.runtime import task_runner as make_task_runner
    from flows.score import score
    from tasks.score.scoring import cut_pieces

    settings = runner_for(settings, len(cut_pieces(files, piece_rows or PIECE_ROWS)))
    flow = score.with_options(task_runner=make_task_runner(settings))
    bar = progress_bar("rows", show=show_progress)
    with (
        stoppable(),
        tempfile.TemporaryDirectory(prefix="mlstm-score-") as folder,
        prefect_api(settings),
        bar,
        progress.reporting_to(RichSink(bar)),
        local_dask_workers(settings),
    ):
        return flow(
            inputs=inputs,
            output=output,
            model=model,
            text_column=text_column,
            id_columns=id_columns or [],
            piece_rows=piece_rows or PIECE_ROWS,
            described=str(save_described(files, Path(folder) / "inputs.json")),
            workers=settings.max_workers,
            precision=precision,
        )


# The command's parameters as flags: each is declared once, in tasks/score/config.py and (the workers',
# shared with `corpus build`) tasks/settings.py.
SETTINGS = ("output", "model", "text_column", "id_columns", "piece_rows", "precision")
WORKER_SETTINGS = tuple(WorkerOptions.model_fields)


@app.command(rich_help_panel=PANEL)
@options_from(ScoreParams, SETTINGS)
@options_from(WorkerOptions, WORKER_SETTINGS)
def score(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="CSV, JSON-lines (.gz too), Parquet or Arrow files; folders, globs or s3:// prefixes."
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    **settings: Any,
) -> None:
    """Score every row of review tables with a registered classifier: Parquet + a manifest, resumable."""
    from tasks.corpus.sources import SourceError, expand_sources
    from tasks.score.formats import SUFFIXES

    params = parsed(ScoreParams, {name: settings[name] for name in SETTINGS})
    workers = parsed(WorkerOptions, {name: settings[name] for name in WORKER_SETTINGS})
    try:
        if local := [i for i in inputs if "://" not in i or i.startswith("file://")]:
            # A missing local input is refused before pyarrow, Prefect, MLflow and torch are imported.
            expand_sources(local, suffixes=SUFFIXES)
    except SourceError as error:
        raise fail(error) from None
    try:
        summary = run_score(
            inputs,
            output=params.output,
            model=params.model,
            text_column=params.text_column,
            id_columns=params.id_columns,
            piece_rows=params.piece_rows,
            task_runner=workers.task_runner,
            workers=workers.workers,
            precision=params.precision,
        )
    except user_errors() as error:  # InputError and ModelNotFound are ValueErrors
        raise fail(error) from None
    if as_json:
        print(json.dumps(summary.model_dump()))
        return
    out.print(
        styled("scored", "bold green"),
        f"{summary.rows_out:,} of {summary.rows_in:,} rows with "
        f"{summary.model_uri} (v{summary.model_version}), {summary.rejected:,} rejected; "
        f"pieces: {summary.pieces_scored} scored, {summary.pieces_skipped} skipped",
    )
    out.print(f"output: {summary.output}\nmanifest: {summary.manifest_uri}", highlight=False)
