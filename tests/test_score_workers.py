"""A scoring worker's speed and memory rules (issue 30), on the IMDB slice with the champion (conftest.py),
guarded by counting, not timing: the model loaded once and a window read once for a worker's pieces,
pieces of like length (a window's rows ordered by text bytes); a worker's feature batches take its share
of the memory budget, on a GPU of half its free memory; a table of one piece scored on a thread of the
command; the bar and a piece's progress artifact move by batch; a local Dask cluster's workers keep
glibc's heap trimming and run no profiler."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from score_helpers import PIECE_ROWS, SLICE_ROWS, imdb_rows, run_scoring


def test_pieces_hold_texts_of_like_length_and_share_a_worker_s_model_and_window(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The speed rules of a worker: the model is loaded once whatever number of pieces it scores (again
    only for other weights), a window of the input is read once for all its pieces, and a piece holds
    the window's rows of like length (each piece's shortest text at least the next piece's longest), so
    the features path pads and steps little, in parts of like bytes; the pieces' rows are every row
    once."""
    import dataclasses
    import itertools

    from models.classifier import SentimentClassifier
    from tasks.score import scoring
    from tasks.score.tracking import resolve_model
    from tasks.settings import get_settings

    loads: list[Path] = []
    load = SentimentClassifier.load
    monkeypatch.setattr(SentimentClassifier, "load", lambda folder: loads.append(folder) or load(folder))
    reads: list[tuple[int, int]] = []
    read_rows = scoring.read_rows
    monkeypatch.setattr(
        scoring,
        "read_rows",
        lambda file, start, stop, **kw: reads.append((start, stop)) or read_rows(file, start, stop, **kw),
    )
    scoring._classifier.cache_clear()
    scoring._window.cache_clear()

    files = scoring.describe_inputs([str(imdb_slice)])
    plan = scoring.plan_scoring(
        files, str(tmp_path / "out"), resolve_model(None, get_settings()), piece_rows=PIECE_ROWS
    )
    assert [(p.start, p.stop, p.part, p.parts) for p in plan.pieces] == [
        (0, SLICE_ROWS, j, 4) for j in range(4)
    ]
    for piece in plan.pieces:
        scoring.score_piece(plan, piece)
    assert len(loads) == 1 and reads == [(0, SLICE_ROWS)], (loads, reads)

    inputs = imdb_rows(imdb_slice, every=1, limit=SLICE_ROWS)
    lengths = []
    rows: list[int] = []
    for piece in plan.pieces:
        part = pq.read_table(Path(plan.output) / f"part-{piece.name}.parquet")
        piece_rows = part.column("input_row").to_pylist()
        assert piece_rows == sorted(piece_rows)  # input order within a part
        rows += piece_rows
        lengths.append([len(inputs[r]["text"].encode()) for r in piece_rows])
    assert sorted(rows) == list(range(SLICE_ROWS))
    for longer, shorter in itertools.pairwise(lengths):
        assert min(longer) >= max(shorter), (min(longer), max(shorter))
    # Parts of like bytes (a row's text plus ROW_BYTES), so no worker holds the run up with the longest.
    costs = [sum(piece) + scoring.ROW_BYTES * len(piece) for piece in lengths]
    assert max(costs) - min(costs) <= max(map(max, lengths)) + scoring.ROW_BYTES, costs

    other = dataclasses.replace(plan, model=dataclasses.replace(plan.model, weights_sha256="0" * 64))
    scoring.score_piece(other, dataclasses.replace(plan.pieces[0], index=len(plan.pieces)))
    assert len(loads) == 2  # the same version's folder with other weights is loaded again


def test_window_order_is_by_text_bytes_longest_first() -> None:
    from tasks.score.scoring import window_order

    texts = pa.array([b"ab", None, b"abcd", b"", b"abcd", "é".encode()], type=pa.binary())
    assert window_order(texts).tolist() == [2, 4, 0, 5, 1, 3]
    assert window_order(pa.chunked_array([pa.array(["a", "abc"])])).tolist() == [1, 0]
    assert window_order(pa.array([5, 7])).tolist() == [0, 1]  # not text: rejected later, order as read


def test_local_dask_workers_keep_glibc_s_own_heap_trimming_and_do_not_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_ in its workers, which turns glibc's adaptive mmap
    threshold off and made the features path about 20 % slower there; a worker's profiler takes the GIL
    every 10 ms from the features path's Python loop (about 30 % slower). `score` starts its local
    cluster without either."""
    import os

    from distributed import Client, LocalCluster

    from flows.runtime import local_dask_workers
    from tasks.settings import get_settings

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)  # a nanny before this one leaves it set
    with (
        local_dask_workers(get_settings(task_runner="dask")),
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        assert list(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()) == [None]

        def spin(seconds: float) -> None:  # busy in Python: a sleeping thread is not what a profiler counts
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                pass

        # Sent by value (a local function): a worker need not import this test module.
        client.submit(spin, 1.5).result(timeout=60)  # the profiler, when on, sampled such a task 75 times
        assert client.profile()["count"] == 0


def test_a_worker_s_feature_batches_take_its_share_of_the_run_s_memory(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory is bounded by the settings, not by the input: the features path of each of N workers is
    given 1/N of MLSTM_SCORE_MEMORY_MIB for its batches (N workers each taking the whole budget made a
    run's peak grow with the input, as more of its batches filled up; issue 30). Thread workers, so the
    calls are seen here."""
    import models.features
    from tasks.settings import get_settings

    budgets: list[int | None] = []
    featurize = models.features.featurize
    monkeypatch.setattr(
        models.features,
        "featurize",
        lambda model, texts, **kw: budgets.append(kw.get("memory_bytes")) or featurize(model, texts, **kw),
    )
    monkeypatch.setenv("MLSTM_SCORE_MEMORY_MIB", "600")
    summary = run_scoring([str(imdb_slice)], str(tmp_path / "out"), task_runner="thread", workers=3)
    assert summary["pieces_scored"] == 4
    assert budgets == [600 * 2**20 // 3] * 4, budgets
    assert get_settings().score_memory_mib == 600
    # A run of one piece: nothing runs beside it, so its batches take the whole budget.
    budgets.clear()
    summary = run_scoring(
        [str(imdb_slice)], str(tmp_path / "one"), task_runner="thread", workers=3, piece_rows=SLICE_ROWS
    )
    assert summary["pieces_scored"] == 1 and budgets == [600 * 2**20], budgets


def test_the_bar_moves_by_batch_for_a_piece_on_a_thread_and_counts_each_row_once(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of one piece runs on a thread of the command: its bar moves as each batch is scored, not
    from 0 to done at the piece's end; with several pieces each row is still told once."""
    import flows.cli.score

    told: list[float] = []

    class Bar:  # the command's sinks: describing the inputs, then scoring them
        def stage(self, description: str, total: float) -> None:
            told.clear()

        def advance(self, amount: float = 1) -> None:
            told.append(amount)

        def note(self, message: str) -> None:
            pass

    monkeypatch.setattr(flows.cli.score, "RichSink", lambda bar: Bar())
    monkeypatch.setenv("MLSTM_SCORE_MEMORY_MIB", "8")
    summary = run_scoring([str(imdb_slice)], str(tmp_path / "one"), piece_rows=SLICE_ROWS)
    assert summary["pieces_scored"] == 1 and sum(told) == SLICE_ROWS and len(told) > 2, told
    summary = run_scoring([str(imdb_slice)], str(tmp_path / "four"))
    assert summary["pieces_scored"] == 4 and sum(told) == SLICE_ROWS, told


@pytest.mark.parametrize(
    ("runner", "piece_rows", "runs_on"),
    [("process", SLICE_ROWS, "thread"), ("process", PIECE_ROWS, "process"), ("dask", SLICE_ROWS, "dask")],
)
def test_a_table_of_one_piece_is_scored_on_a_thread_of_the_command(
    runner: str,
    piece_rows: int,
    runs_on: str,
    imdb_slice: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One piece has nothing to run beside it, and a process pool's worker start (importing torch,
    Prefect and MLflow) was most of a small table's run (benchmarks/score_fixed.py): it runs on a thread
    of the command. Several pieces keep the pool; a runner named otherwise is kept."""
    import flows.runtime
    from flows.cli.score import run_score

    class Chosen(Exception):
        """Raised where the runner is made: the choice is the test, not the run."""

    def choose(settings: Any) -> Any:
        raise Chosen(settings.task_runner)

    monkeypatch.setattr(flows.runtime, "task_runner", choose)
    with pytest.raises(Chosen) as chosen:
        run_score([str(imdb_slice)], output=str(tmp_path), piece_rows=piece_rows, task_runner=runner)
    assert str(chosen.value) == runs_on


@pytest.mark.slow
def test_a_piece_s_progress_artifact_grows_as_its_batches_are_scored(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Prefect UI shows each piece's rows scored as they go, not 0 then 100 at its end: with a small
    memory budget a piece runs in several batches, each told to its artifact (every update here, none
    held back). Thread workers, so the updates are seen here; and so is the lone worker's thread count:
    one for the tiny model, though it has the machine's cores to itself (``tasks.jobs.threads``)."""
    import flows.score
    import tasks.score.scoring

    updates: dict[Any, list[float]] = {}
    real = flows.score.update_progress_artifact
    monkeypatch.setattr(flows.score, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(
        flows.score,
        "update_progress_artifact",
        lambda id, progress: updates.setdefault(id, []).append(progress) or real(id, progress=progress),
    )
    monkeypatch.setenv("MLSTM_SCORE_MEMORY_MIB", "32")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the test workers' own share is not the rule's
    taken: list[int] = []  # OpenMP's thread count is the calling thread's: the worker's, not seen here
    share = tasks.score.scoring.take_share
    monkeypatch.setattr(
        tasks.score.scoring, "take_share", lambda **kw: taken.append(share(**kw)) or taken[-1]
    )
    summary = run_scoring([str(imdb_slice)], str(tmp_path / "out"), task_runner="thread", workers=1)
    assert taken == [1] * 4, taken
    assert summary["pieces_scored"] == 4 and len(updates) == 4  # a piece each (the CLI described)
    for shown in updates.values():
        assert shown == sorted(shown) and shown[-1] == 100.0, shown
    assert sum(1 for shown in updates.values() if any(0 < p < 100 for p in shown)) >= 4, updates


def test_workers_on_a_gpu_share_half_its_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the budget setting does not apply: the workers on one device share half its free memory,
    the features path's own default (``models.features.batch_memory_default``), split among them. The
    device's queries are answered here: the rule, not a GPU, is under test."""
    import torch

    from models.config import tiny
    from models.features import rows_for_memory
    from models.mlstm import MLSTM
    from tasks.score.scoring import batch_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    gpu = torch.device("cuda", 0)
    # 5 workers on 2 GPUs: up to 3 on one, each a third of half of 8 GiB; the CPU budget is ignored.
    assert batch_memory(gpu, workers=5, budget=2**20) == 4 * 2**30 // 3
    assert batch_memory(torch.device("cpu"), workers=4, budget=2**30) == 2**28
    model = MLSTM(tiny())
    assert rows_for_memory(model, gpu) == rows_for_memory(model, gpu, memory_bytes=4 * 2**30)
