"""Batch scoring (issue 30): `score` on a slice of the shared IMDB test set with a classifier trained
here (a tiny mLSTM's features, a probe fitted on IMDB train reviews) and registered as champion.

Guards: every input row is in the output exactly once; labels and probabilities agree with `predict`'s
model; the manifest's checksums verify; a run stopped after its first piece scores only the rest;
S3 (moto) input and output; the Dask runner writes the same bytes as the process pool; bad rows are
written aside with their reason, and a bad file is one error naming it. The speed rules of a worker
(the model loaded once, a window read once, pieces of like length) are guarded by counting, not timing.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

# At the top, as the other tests do: imported by name inside a test, conftest would run again (a
# module of its own) and clear the MLSTM_ variables and PREFECT_API_URL that the fixtures set.
from conftest import cli_in_process

from tasks.store import open_store

SLICE_ROWS = 240  # every 100th review of IMDB test: both labels, lengths as they come
PIECE_ROWS = 64  # four pieces, the last one short


@pytest.fixture(scope="module")
def scoring_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """MLSTM_HOME for the module: its MLflow database holds the champion. A run has one worker process
    (conftest); the test of every row once takes two."""
    home = tmp_path_factory.mktemp("score-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(home))
        yield home


def _imdb_rows(path: Path, every: int, limit: int) -> list[dict[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as stream:
        return [row for i, row in enumerate(csv.DictReader(stream)) if i % every == 0][:limit]


@pytest.fixture(scope="module")
def champion(scoring_home: Path, shared_data: Path, prefect_api_url: str) -> dict[str, Any]:
    """A tiny classifier trained here: a random tiny mLSTM's features of 200 IMDB train reviews and an
    L2 logistic probe on them, logged and registered as models:/mlstm-sentiment@champion."""
    import mlflow
    import torch
    from mlflow.tracking import MlflowClient
    from sklearn.linear_model import LogisticRegression

    from models.classifier import SentimentClassifier
    from models.features import featurize
    from models.mlstm import MLSTM, tiny
    from tasks.settings import get_settings
    from tasks.tracking import connect
    from tasks.transfer.registry import log_classifier

    rows = _imdb_rows(shared_data / "imdb" / "train.csv.gz", every=125, limit=200)
    torch.manual_seed(0)
    model = MLSTM(tiny())
    features_NH = featurize(model, [r["text"] for r in rows], batch_size=None)
    probe = LogisticRegression(C=1.0, max_iter=1000).fit(features_NH, [int(r["label"]) for r in rows])
    classifier = SentimentClassifier(model, probe.coef_[0], float(probe.intercept_[0]))
    settings = get_settings()
    connect(settings)
    with mlflow.start_run() as run:
        pass
    uri = log_classifier(run.info.run_id, classifier, "classifier")
    version = mlflow.register_model(uri, settings.model_name)
    MlflowClient().set_registered_model_alias(settings.model_name, "champion", version.version)
    return {"classifier": classifier, "version": int(version.version), "run_id": run.info.run_id}


@pytest.fixture(scope="module")
def imdb_slice(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SLICE_ROWS reviews of the IMDB test set, as the shared file is: gzip CSV id,rating,label,text."""
    rows = _imdb_rows(shared_data / "imdb" / "test.csv.gz", every=100, limit=SLICE_ROWS)
    path = tmp_path_factory.mktemp("imdb-slice") / "test-slice.csv.gz"
    with gzip.open(path, "wt", encoding="utf-8", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=["id", "rating", "label", "text"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def _score(inputs: list[str], output: str, **options: Any) -> dict[str, Any]:
    """The score flow as the CLI runs it, on threads unless the test names its task runner: a process
    pool's worker imports torch, Prefect and MLflow first (5-8 s of CPU), and only the tests of the
    runners are about it (``scored``, the killed run, Dask against the pool)."""
    import torch

    from flows.cli.score import run_score

    options.setdefault("task_runner", "thread")
    options.setdefault("piece_rows", PIECE_ROWS)
    threads = torch.get_num_threads()
    try:
        return run_score(inputs, output=output, show_progress=False, **options).model_dump()
    finally:
        torch.set_num_threads(threads)  # a thread worker sets this process's


def _parts(output: str, prefix: str = "part-") -> pa.Table:
    store = open_store(output)
    keys = [k for k in store.list("") if k.rpartition("/")[2].startswith(prefix) and "rejected/" not in k]
    return pa.concat_tables(pq.read_table(io.BytesIO(store.read_bytes(k))) for k in keys)


@pytest.fixture(scope="module")
def scored(
    champion: dict[str, Any], imdb_slice: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """One run of the score flow on the slice with two worker processes, shared by the tests that read
    what it wrote or sent: its summary, the plans its piece task was mapped with, its flow run."""
    from prefect.client.orchestration import get_client

    from flows.score import score_piece_task

    mapped: list[Any] = []
    real = score_piece_task.map
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            score_piece_task,
            "map",
            lambda plan, pieces, **kw: mapped.append(plan) or real(plan, pieces, **kw),
        )
        output = tmp_path_factory.mktemp("scored") / "out"
        summary = _score([str(imdb_slice)], str(output), id_columns=["id"], task_runner="process", workers=2)
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_runs(sort="START_TIME_DESC", limit=1)[0]
    return {"summary": summary, "output": str(output), "mapped": mapped, "flow_run": flow_run}


def test_every_row_once_labels_agree_with_predict_checksums_verify(
    champion: dict[str, Any], imdb_slice: Path, scored: dict[str, Any]
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.cli.common import load_registered
    from tasks.score.scoring import verify

    summary = scored["summary"]
    assert summary["rows_in"] == summary["rows_out"] == SLICE_ROWS, summary
    assert summary["rejected"] == 0 and summary["pieces_scored"] == 4, summary
    assert summary["model_version"] == champion["version"]

    scores = _parts(summary["output"])
    # IMDB's ids count within a label (0 is a positive and a negative review): a row is (file, row).
    assert sorted(scores.column("input_row").to_pylist()) == list(range(SLICE_ROWS))
    inputs = _imdb_rows(imdb_slice, every=1, limit=SLICE_ROWS)
    by_row = {row: int(r["id"]) for row, r in enumerate(inputs)}
    assert [by_row[r] for r in scores.column("input_row").to_pylist()] == scores.column("id").to_pylist()
    assert set(scores.column("model_version").to_pylist()) == {champion["version"]}

    # `predict`'s own model (the registered pyfunc, as `mlstm-sentiment predict` loads it) on a sample.
    text_of = {row: r["text"] for row, r in enumerate(inputs)}
    sample = scores.to_pylist()[::12]
    pyfunc, _ = load_registered(None)
    import pandas as pd

    predicted = pyfunc.predict(pd.DataFrame({"text": [text_of[r["input_row"]] for r in sample]}))
    assert [r["label"] for r in sample] == list(predicted["label"])
    np.testing.assert_allclose([r["probability"] for r in sample], predicted["probability"], rtol=1e-5)
    unit = int(np.argmax(np.abs(champion["classifier"].coef_H)))
    from models.features import featurize

    # The sentiment unit's value is that unit's feature: the cell state after the text's last byte.
    features_NH = featurize(champion["classifier"].model, [text_of[r["input_row"]] for r in sample[:3]])
    np.testing.assert_allclose([r["sentiment_unit"] for r in sample[:3]], features_NH[:, unit], rtol=1e-5)

    assert verify(summary["output"]) == []
    manifest = json.loads((Path(summary["output"]) / "manifest.json").read_text())
    assert (
        manifest["inputs"][0]["sha256"] == __import__("hashlib").sha256(imdb_slice.read_bytes()).hexdigest()
    )
    assert manifest["model"]["uri"] == "models:/mlstm-sentiment@champion"

    # One MLflow run, a child of the run that logged the version, with the histogram.
    runs = mlflow.search_runs(
        search_all_experiments=True, filter_string="tags.scoring_id != ''", output_format="list"
    )
    (run,) = [r for r in runs if r.data.tags["output"] == summary["output"]]
    assert run.data.tags["mlflow.parentRunId"] == champion["run_id"]
    assert run.data.metrics["rows_out"] == SLICE_ROWS and run.data.metrics["rows_per_s"] > 0
    assert "probability_histogram.png" in [a.path for a in MlflowClient().list_artifacts(run.info.run_id)]

    # A rerun finds the published output and scores nothing; so does the flow run alone, as a
    # deployment runs it, describing its inputs itself (the CLI describes them before Prefect starts).
    again = _score([str(imdb_slice)], scored["output"], id_columns=["id"])
    assert again["output"] == summary["output"] and again["pieces_scored"] == 0
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.runtime import prefect_api
    from flows.score import score
    from tasks.settings import get_settings

    with prefect_api(get_settings()):
        alone = score(
            inputs=[str(imdb_slice)], output=scored["output"], id_columns=["id"], piece_rows=PIECE_ROWS
        )
        # Describing shows on the flow run's page, as a piece does (minutes for 40 GB).
        with get_client(sync_client=True) as prefect:
            described = prefect.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["score-describe"]))
            )
    assert alone.output == summary["output"] and alone.pieces_skipped == 4, alone
    assert described and {a.data for a in described} == {100.0}, described


def test_each_piece_s_task_takes_the_plan_without_every_piece(scored: dict[str, Any]) -> None:
    """The flow maps its pieces with ``Plan.for_pieces()``: a task's arguments stay the same size
    however many pieces the run has (``test_score_inputs.py`` measures them)."""
    assert scored["summary"]["rows_out"] == SLICE_ROWS and len(scored["mapped"]) == 1
    assert scored["mapped"][0].pieces == () and scored["mapped"][0].files == ()


def test_the_flow_run_s_parameters_do_not_hold_the_inputs_offsets(scored: dict[str, Any]) -> None:
    """Prefect refuses a flow run whose parameters pass 512 KB, and the described inputs' row offsets
    of the 2014 corpus (82M reviews) are 1 MB of JSON: the CLI hands them over as a file."""
    run = scored["flow_run"]
    parameters = json.dumps(run.parameters)
    assert run.name.startswith("score-") and "offsets" not in parameters and len(parameters) < 2048, (
        parameters
    )
    assert run.parameters["described"].endswith("inputs.json")
    assert not Path(run.parameters["described"]).exists()  # the CLI's, removed when the run ends


def test_a_run_stopped_after_its_first_piece_scores_only_the_rest(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path
) -> None:
    """The first piece scored by the plain function (as a run killed after it would leave it); the
    flow then scores the other three and publishes every row once."""
    from tasks.score.scoring import describe_inputs, plan_scoring, score_piece
    from tasks.score.tracking import resolve_model
    from tasks.settings import get_settings

    output = str(tmp_path / "out")
    files = describe_inputs([str(imdb_slice)])
    plan = plan_scoring(files, output, resolve_model(None, get_settings()), piece_rows=PIECE_ROWS)
    first = score_piece(plan, plan.pieces[0])
    # Pieces are cut by bytes (``window_cuts``): the first holds the longest texts, fewer rows.
    assert 0 < first["rows_out"] == first["rows_in"] < PIECE_ROWS
    assert not (Path(plan.output) / "manifest.json").exists()

    summary = _score([str(imdb_slice)], output)
    assert (summary["pieces_scored"], summary["pieces_skipped"]) == (3, 1), summary
    assert summary["output"] == plan.output
    assert sorted(_parts(summary["output"]).column("input_row").to_pylist()) == list(range(SLICE_ROWS))


@pytest.fixture(scope="module")
def bf16_scored(
    champion: dict[str, Any], imdb_slice: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """`score --precision bf16` of the slice, read by both tests of precision: bf16 features on a CPU
    that emulates them take several times fp32's time, so the slice is read in bf16 once here, not once
    a test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "bf16 features on a CPU")  # slower, same values
        return _score([str(imdb_slice)], str(tmp_path_factory.mktemp("bf16") / "out"), precision="bf16")


@pytest.mark.filterwarnings("ignore:bf16 features on a CPU")  # a CPU that emulates bf16: slower, same values
def test_an_auto_output_begun_on_a_gpu_reads_its_other_pieces_in_bf16_on_a_cpu(
    champion: dict[str, Any], imdb_slice: Path, bf16_scored: dict[str, Any], tmp_path: Path
) -> None:
    """auto is bf16 on a GPU and fp32 on a CPU: an output whose first piece a GPU scored (its
    ``precision.json``) reads its other pieces in bf16 on a CPU too, the scores `--precision bf16`
    gives, so one output never holds two dtypes' scores; the manifest says which."""
    from tasks.score.scoring import describe_inputs, plan_scoring
    from tasks.score.tracking import resolve_model
    from tasks.settings import get_settings

    output = str(tmp_path / "out")
    files = describe_inputs([str(imdb_slice)])
    model = resolve_model(None, get_settings())
    auto = plan_scoring(files, output, model, piece_rows=PIECE_ROWS)
    Path(auto.output).mkdir(parents=True)
    (Path(auto.output) / "precision.json").write_text(json.dumps({"precision": "auto", "dtype": "bf16"}))
    summary = _score([str(imdb_slice)], output)
    assert summary["output"] == auto.output and summary["pieces_scored"] == 4, summary
    manifest = json.loads((Path(auto.output) / "manifest.json").read_text())
    assert (manifest["precision"], manifest["dtype"]) == ("auto", "bf16")
    bf16 = bf16_scored["output"]
    assert Path(bf16).name != Path(auto.output).name  # a scoring id of its own, though both read bf16
    in_auto, in_bf16 = (_parts(out).sort_by("input_row") for out in (auto.output, bf16))
    np.testing.assert_array_equal(in_auto.column("probability"), in_bf16.column("probability"))


def test_bf16_scores_go_to_an_output_of_their_own_near_fp32_s(
    champion: dict[str, Any], imdb_slice: Path, bf16_scored: dict[str, Any]
) -> None:
    """`score --precision bf16` reads a probe's features in bf16: another scoring id (a run never mixes
    the two), said in the manifest, probabilities near fp32's and not equal to them."""
    from tasks.score.scoring import describe_inputs, plan_scoring, score_piece
    from tasks.score.tracking import resolve_model
    from tasks.settings import get_settings

    output = str(Path(bf16_scored["output"]).parent)  # where the bf16 run wrote, under its scoring id
    files = describe_inputs([str(imdb_slice)])
    model = resolve_model(None, get_settings())
    auto = plan_scoring(files, output, model, piece_rows=PIECE_ROWS)
    bf16 = plan_scoring(files, output, model, piece_rows=PIECE_ROWS, precision="bf16")
    assert bf16.scoring_id != auto.scoring_id
    with pytest.raises(ValueError, match="precision 'fp8' is not one of auto, bf16, fp16, fp32"):
        plan_scoring(files, output, model, precision="fp8")
    assert score_piece(auto, auto.pieces[0])["dtype"] == "fp32"  # auto on a CPU, claimed for the output
    assert json.loads((Path(auto.output) / "precision.json").read_text())["dtype"] == "fp32"
    summary = bf16_scored
    assert summary["output"] == bf16.output and summary["pieces_scored"] == 4, summary
    manifest = json.loads((Path(bf16.output) / "manifest.json").read_text())
    assert (manifest["precision"], manifest["dtype"]) == ("bf16", "bf16")
    fp32 = _parts(auto.output).sort_by("input_row")
    rows = set(fp32.column("input_row").to_pylist())
    in_bf16 = _parts(bf16.output).filter(pc.is_in(pc.field("input_row"), pa.array(sorted(rows))))
    in_bf16 = in_bf16.sort_by("input_row")
    assert in_bf16.column("input_row").to_pylist() == fp32.column("input_row").to_pylist()
    p_fp32, p_bf16 = fp32.column("probability").to_numpy(), in_bf16.column("probability").to_numpy()
    assert not np.array_equal(p_bf16, p_fp32)
    np.testing.assert_allclose(p_bf16, p_fp32, atol=0.02)


@pytest.mark.slow
def test_a_killed_run_resumes_where_it_stopped(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path
) -> None:
    """`mlstm-sentiment score` killed (SIGKILL, the whole process group) once a piece is done; the
    rerun skips what was published and scores the rest."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    output = tmp_path / "out"
    command = [sys.executable, "-c", "from flows.cli import main; main()", "score", str(imdb_slice)]
    command += ["--output", str(output)]
    # On threads: the command's own process scores (the pool's worker would import everything again).
    command += ["--piece-rows", str(PIECE_ROWS), "--workers", "1", "--task-runner", "thread"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not list(output.glob("*/pieces/*.json")):
            assert process.poll() is None, process.stderr.read().decode()[-2000:] if process.stderr else ""
            assert time.monotonic() < deadline, "no piece was published in 300 s"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    done = len(list(output.glob("*/pieces/*.json")))
    assert 1 <= done < 4 and not list(output.glob("*/manifest.json"))

    summary = _score([str(imdb_slice)], str(output))
    assert (summary["pieces_scored"], summary["pieces_skipped"]) == (4 - done, done), summary
    assert sorted(_parts(summary["output"]).column("input_row").to_pylist()) == list(range(SLICE_ROWS))


def test_bad_rows_are_written_aside_with_their_reason(champion: dict[str, Any], tmp_path: Path) -> None:
    lines = [
        b'{"id": 1, "text": "A warm, funny film."}',
        b'{"id": 2, "text": ""}',
        b'{"id": 3, "text": 5}',
        b'{"id": 4, "text": "caf\xe9 au lait"}',  # Latin-1, not UTF-8
        b"{not json",
        b'{"id": 6, "review": "the text is under another name"}',
        b'{"id": 7, "text": "Dull and far too long."}',
    ]
    jsonl = tmp_path / "in" / "reviews.jsonl.gz"
    jsonl.parent.mkdir()
    jsonl.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    (tmp_path / "in" / "more.csv").write_bytes(b'id,text\n8,Loved it.\n9,\n10,"na\xefve"\n')
    summary = _score([str(tmp_path / "in")], str(tmp_path / "out"), id_columns=["id"])
    assert (summary["rows_in"], summary["rows_out"], summary["rejected"]) == (10, 3, 7), summary

    store = open_store(summary["output"])
    aside = pa.concat_tables(
        pq.read_table(io.BytesIO(store.read_bytes(k)))
        for k in store.list("rejected")
        if k.endswith(".parquet")
    )
    reasons = dict(zip(aside.column("id").to_pylist(), aside.column("reason").to_pylist(), strict=True))
    assert reasons == {
        2: "empty",
        3: "not text (int)",
        4: "not UTF-8 at byte 3",
        None: "not JSON",
        6: "no 'text' field",
        9: "empty",
        10: "not UTF-8 at byte 2",
    }, aside.to_pylist()
    assert sorted(_parts(summary["output"]).column("id").to_pylist()) == [1, 7, 8]
    manifest = json.loads((Path(summary["output"]) / "manifest.json").read_text())
    assert manifest["rejected"]["rows"] == 7


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("reviews.csv", b"id,review\n1,great\n", "no column 'text' (it has 'id', 'review')"),
        ("reviews.parquet", b"id,text\n1,great\n", "not a readable Parquet file"),
        ("reviews.arrow", b"id,text\n1,great\n", "not a readable Arrow IPC file"),
        ("reviews.jsonl", b'{"id": 1, "review": "great"}\n', "no record has a 'text' field"),
        ("reviews.txt", b"great\n", "not a table this command reads"),
        ("header-only.csv", b"id,text\n", "no rows to score"),
    ],
)
def test_a_bad_file_is_one_error_naming_it(
    name: str, content: bytes, says: str, tmp_path: Path, prefect_api_url: str
) -> None:
    from prefect.client.orchestration import get_client

    def flow_runs() -> int:
        with get_client(sync_client=True) as prefect:
            return len(prefect.read_flow_runs())

    bad = tmp_path / name
    bad.write_bytes(content)
    before = flow_runs()
    done = cli_in_process(
        ["score", str(bad), "--output", str(tmp_path / "out")], env={"MLSTM_HOME": str(tmp_path / "home")}
    )
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert message.startswith(f"error: {bad}: ") and says in message, message
    assert not (tmp_path / "out").exists()
    # Refused before Prefect: no failed flow run, whose log lines would stand in front of the error.
    assert flow_runs() == before


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_that_cannot_be_a_folder_is_named_by_its_flag(where: str, tmp_path: Path) -> None:
    """`--output FILE` is one line naming --output (not MLSTM_STORE_URI), before the inputs are read
    or Prefect starts (its API here answers nothing), and nothing is made."""
    reviews = tmp_path / "reviews.csv"
    reviews.write_text("id,text\n1,great\n")
    taken = tmp_path / "taken"
    taken.write_text("a file of the user's")
    output = taken if where == "a file" else taken / "scores"
    env: dict[str, str | None] = {
        "MLSTM_HOME": str(tmp_path / "home"),
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
    }
    done = cli_in_process(["score", str(reviews), "--output", str(output)], env)
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert message == f"error: --output {output}: {taken} is a file, not a folder", message
    assert taken.read_text() == "a file of the user's"


def test_s3_input_and_output(
    champion: dict[str, Any], imdb_slice: Path, s3_bucket: str, tmp_path: Path
) -> None:
    import boto3
    import pyarrow.csv as pacsv

    from tasks.score.scoring import verify

    table = pacsv.read_csv(imdb_slice).slice(0, 96)
    local = tmp_path / "slice.parquet"
    pq.write_table(table, local)
    boto3.client("s3").upload_file(str(local), s3_bucket, "in/reviews/slice.parquet")
    summary = _score(
        [f"s3://{s3_bucket}/in/reviews/"], f"s3://{s3_bucket}/scores", id_columns=["id", "rating"]
    )
    assert summary["output"].startswith(f"s3://{s3_bucket}/scores/mlstm-sentiment-v")
    assert (summary["rows_out"], summary["pieces_scored"]) == (96, 2), summary
    assert verify(summary["output"]) == []
    # Pieces are cut by length (a part's rows are not a run of the input's): by input_row, the ids.
    scores = _parts(summary["output"]).sort_by("input_row")
    assert scores.column("input_row").to_pylist() == list(range(96))
    assert scores.column("id").to_pylist() == table.column("id").to_pylist()


@pytest.mark.long  # a Dask cluster beside a score run: about 50 s
def test_the_dask_runner_writes_the_same_bytes_as_the_process_pool(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path
) -> None:
    def digests(summary: dict[str, Any]) -> list[tuple[str, str]]:
        manifest = json.loads((Path(summary["output"]) / "manifest.json").read_text())
        return [(f["key"], f["sha256"]) for f in manifest["files"]]

    pool = _score([str(imdb_slice)], str(tmp_path / "pool"), id_columns=["id"], task_runner="process")
    dask = _score([str(imdb_slice)], str(tmp_path / "dask"), id_columns=["id"], task_runner="dask", workers=2)
    assert dask["pieces_scored"] == 4 and digests(dask) == digests(pool)


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

    inputs = _imdb_rows(imdb_slice, every=1, limit=SLICE_ROWS)
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
    summary = _score([str(imdb_slice)], str(tmp_path / "out"), task_runner="thread", workers=3)
    assert summary["pieces_scored"] == 4
    assert budgets == [600 * 2**20 // 3] * 4, budgets
    assert get_settings().score_memory_mib == 600
    # A run of one piece: nothing runs beside it, so its batches take the whole budget.
    budgets.clear()
    summary = _score(
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
    summary = _score([str(imdb_slice)], str(tmp_path / "one"), piece_rows=SLICE_ROWS)
    assert summary["pieces_scored"] == 1 and sum(told) == SLICE_ROWS and len(told) > 2, told
    summary = _score([str(imdb_slice)], str(tmp_path / "four"))
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
    summary = _score([str(imdb_slice)], str(tmp_path / "out"), task_runner="thread", workers=1)
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
