"""Batch scoring (issue 30): `score` on a slice of the shared IMDB test set with a classifier trained
here (a tiny mLSTM's features, a probe fitted on IMDB train reviews) and registered as champion.

Guards: every input row is in the output exactly once; labels and probabilities agree with `predict`'s
model; the manifest's checksums verify; a run stopped after its first piece scores only the rest;
S3 (moto) input and output; the Dask runner writes the same bytes as the process pool; bad rows are
written aside with their reason, and a bad file is one error naming it.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.store import open_store

SLICE_ROWS = 240  # every 100th review of IMDB test: both labels, lengths as they come
PIECE_ROWS = 64  # four pieces, the last one short


@pytest.fixture(scope="module")
def scoring_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """MLSTM_HOME for the module: its MLflow database holds the champion."""
    from multiprocessing import resource_tracker

    home = tmp_path_factory.mktemp("score-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(home))
        patch.setenv("MLSTM_MAX_WORKERS", "2")
        yield home
    # The process pool's queues started multiprocessing's resource tracker in this process; it would
    # live as long as the session does.
    resource_tracker._resource_tracker._stop()


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
    from flows.cli.score import run_score

    return run_score(inputs, output=output, piece_rows=PIECE_ROWS, show_progress=False, **options)


def _parts(output: str, prefix: str = "part-") -> pa.Table:
    store = open_store(output)
    keys = [k for k in store.list("") if k.rpartition("/")[2].startswith(prefix) and "rejected/" not in k]
    return pa.concat_tables(pq.read_table(io.BytesIO(store.read_bytes(k))) for k in keys)


def test_every_row_once_labels_agree_with_predict_checksums_verify(
    champion: dict[str, Any], imdb_slice: Path, tmp_path: Path
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.cli.common import load_registered
    from tasks.score.scoring import verify

    summary = _score([str(imdb_slice)], str(tmp_path / "out"), id_columns=["id"])
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
    assert manifest["inputs"][0]["sha256"] == __import__("hashlib").sha256(imdb_slice.read_bytes()).hexdigest()
    assert manifest["model"]["uri"] == "models:/mlstm-sentiment@champion"

    # One MLflow run, a child of the run that logged the version, with the histogram.
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.scoring_id != ''", output_format="list")
    (run,) = [r for r in runs if r.data.tags["output"] == summary["output"]]
    assert run.data.tags["mlflow.parentRunId"] == champion["run_id"]
    assert run.data.metrics["rows_out"] == SLICE_ROWS and run.data.metrics["rows_per_s"] > 0
    assert "probability_histogram.png" in [a.path for a in MlflowClient().list_artifacts(run.info.run_id)]

    # A rerun finds the published output and scores nothing.
    again = _score([str(imdb_slice)], str(tmp_path / "out"), id_columns=["id"])
    assert again["output"] == summary["output"] and again["pieces_scored"] == 0
