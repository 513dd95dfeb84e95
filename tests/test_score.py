"""Batch scoring (issue 30): `score` on a slice of the shared IMDB test set with a classifier trained
here (a tiny mLSTM's features, a probe fitted on IMDB train reviews) and registered as champion.

Guards: every input row is in the output exactly once; labels and probabilities agree with `predict`'s
model; the manifest's checksums verify; a run stopped after its first piece scores only the rest;
S3 (moto) input and output; the Dask runner writes the same bytes as the process pool; bad rows are
written aside with their reason, and a bad file (or an output that cannot be a folder) is one error
naming it. The champion and the slice are conftest.py's fixtures; a worker's speed and memory rules are
in ``test_score_workers.py``.
"""

from __future__ import annotations

import gzip
import io
import json
import warnings
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
from score_helpers import PIECE_ROWS, SLICE_ROWS, imdb_rows, run_scoring

from tasks.store import open_store


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
        summary = run_scoring(
            [str(imdb_slice)], str(output), id_columns=["id"], task_runner="process", workers=2
        )
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
    inputs = imdb_rows(imdb_slice, every=1, limit=SLICE_ROWS)
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
    again = run_scoring([str(imdb_slice)], scored["output"], id_columns=["id"])
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

    summary = run_scoring([str(imdb_slice)], output)
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
        return run_scoring([str(imdb_slice)], str(tmp_path_factory.mktemp("bf16") / "out"), precision="bf16")


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
    summary = run_scoring([str(imdb_slice)], output)
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

    summary = run_scoring([str(imdb_slice)], str(output))
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
    summary = run_scoring([str(tmp_path / "in")], str(tmp_path / "out"), id_columns=["id"])
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
    summary = run_scoring(
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

    pool = run_scoring([str(imdb_slice)], str(tmp_path / "pool"), id_columns=["id"], task_runner="process")
    dask = run_scoring(
        [str(imdb_slice)], str(tmp_path / "dask"), id_columns=["id"], task_runner="dask", workers=2
    )
    assert dask["pieces_scored"] == 4 and digests(dask) == digests(pool)
