"""The transfer stage end to end: features from a trained checkpoint, probes, a real MLflow server,
the registry and its champion alias, the served model, and the classifier's behaviour."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import cli_in_process
from train_helpers import run_job

from models.classifier import SentimentClassifier
from models.features import featurize
from tasks.corpus.sample import write_labelled_sample
from tasks.jobs.checkpoint import load_checkpoint
from tasks.settings import Settings, get_settings
from tasks.transfer import registry
from tasks.transfer.features import features_of
from tasks.transfer.registry import CHAMPION, log_classifier, model_card
from tasks.transfer.result import BaselineReport, ProbeReport, Registration
from tasks.transfer.serve import invoke, served

BIN = Path(sys.executable).parent
CLI = str(BIN / "mlstm-sentiment")
# In the generated reviews' own words: a tiny mLSTM trained for seconds knows little else (a reworded
# "Terrible, do not buy this." fools it), so these check the pipeline's behaviour, not the model's reach.
POSITIVE = "Absolutely love it! I would buy this tuner again in a heartbeat."
NEGATIVE = "Very disappointed. I returned the tuner immediately."


@pytest.fixture(scope="module")
def trained(
    sample_manifest: str, mlflow_server: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A tiny mLSTM trained for one epoch of the generated corpus (about 30 s on two cores), logged to
    the MLflow server."""
    home = tmp_path_factory.mktemp("transfer-home")
    args = ["--corpus", sample_manifest, "--preset", "tiny", "--batch-size", "16", "--seq-len", "64"]
    args += ["--lr", "0.003", "--checkpoint-every", "1000", "--val-every", "1000", "--run-name", "t"]
    result = run_job(args, home, env={"MLSTM_MLFLOW_TRACKING_URI": mlflow_server})
    return {"home": home, "checkpoint": result["checkpoint_uri"]}


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_labelled_sample(tmp_path_factory.mktemp("labelled") / "reviews")


def probe_report(**values: Any) -> ProbeReport:
    """A probe's report with made-up numbers: what registering a version reads of one."""
    made_up = {
        "name": "reviews", "spec": "reviews=/data", "source": "/data", "kind": "table", "checksum": "a" * 64,
        "checkpoint_uri": "x", "dev_from_train": None, "features_precision": "fp32", "rows": {},
        "test_accuracy": 0.5, "dev_accuracy": 0.5, "C": 1.0, "nonzero": 1, "top_unit": 0,
        "top_unit_accuracy": 0.5, "top_unit_sign": 1, "sweep": [], "reference": {}, "baseline": None,
        "probe_uri": "x", "plots": {}, "heatmaps": [],
    }  # fmt: skip
    return ProbeReport.model_validate(made_up | values)


def cli(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def env(trained: dict[str, Any], mlflow_server: str, prefect_api_url: str, tmp_path: Path) -> dict[str, str]:
    """A CLI environment: the trained run's store, a real MLflow server, a registered-model name of its own."""
    return {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "MLSTM_HOME": str(trained["home"]),
        "MLSTM_MLFLOW_TRACKING_URI": mlflow_server,
        "MLSTM_MODEL_NAME": f"sentiment-{tmp_path.name[-24:]}",
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",  # `mlflow models serve` runs uvicorn by name
    }


@pytest.mark.slow  # the module's `trained` fixture trains for about 30 s
def test_features_cli_writes_one_row_per_input_row_and_caches(
    trained: dict[str, Any], shared_data: Path, env: dict[str, str], tmp_path: Path
) -> None:
    dev = shared_data / "sst2" / "dev_binary_sent.csv"
    args = ["features", "--checkpoint", trained["checkpoint"], "--input", str(dev)]
    args += ["--text-column", "sentence", "--label-column", "label", "--output", str(tmp_path / "dev.arrow")]
    first = cli(args, env)
    assert first.returncode == 0, first.stderr
    assert "872 rows × 64 features (computed)" in first.stdout

    table = pa.ipc.open_file(pa.memory_map(str(tmp_path / "dev.arrow"))).read_all()
    assert table.schema.field("features").type == pa.list_(pa.float32(), 64)
    import csv

    with dev.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert table.column("label").to_pylist() == [int(r["label"]) for r in rows]
    model = load_checkpoint(trained["checkpoint"]).model()
    # Alone, one text per batch, no padding at all: the batched, length-sorted file must agree row by row.
    alone = featurize(model, [r["sentence"] for r in rows[:40]], batch_size=1)
    np.testing.assert_allclose(features_of(table)[:40], alone, rtol=1e-5, atol=1e-6)

    again = cli(args, env)
    assert again.returncode == 0, again.stderr
    assert "(from the cache)" in again.stdout
    cached = sorted((trained["home"] / "store" / "features").rglob("*.arrow"))
    assert len(cached) == 1

    # --precision bf16 reads in bf16: its own file, near the fp32 one, not equal to it.
    args[args.index("--output") + 1] = str(tmp_path / "dev-bf16.arrow")
    bf16 = cli([*args, "--precision", "bf16"], env)
    assert bf16.returncode == 0 and "(computed)" in bf16.stdout, bf16.stderr
    in_bf16 = features_of(pa.ipc.open_file(pa.memory_map(str(tmp_path / "dev-bf16.arrow"))).read_all())
    assert not np.array_equal(in_bf16, features_of(table))
    np.testing.assert_allclose(in_bf16, features_of(table), atol=2e-2 * np.abs(features_of(table)).max())
    bad = cli([*args, "--precision", "fp8"], env)
    assert bad.returncode == 2 and "fp8" in bad.stderr, bad.stderr


@pytest.mark.slow  # the module's `trained` fixture trains for about 30 s
def test_features_cli_names_the_file_and_line_of_bad_input(
    env: dict[str, str], trained: dict[str, Any], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    result = cli(
        ["features", "--checkpoint", trained["checkpoint"], "--input", str(bad), "--output", "x.arrow"], env
    )
    assert result.returncode == 2
    assert "bad.jsonl" in result.stderr and "line 2" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.long
def test_transfer_registers_a_champion_that_serves_and_behaves(
    trained: dict[str, Any], labelled: Path, shared_data: Path, env: dict[str, str]
) -> None:
    datasets = ["--dataset", f"reviews={labelled}", "--dataset", f"sst2={shared_data / 'sst2'}"]
    result = cli(["transfer", "--checkpoint", trained["checkpoint"], *datasets, "--json"], env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert set(summary) == {"reviews", "sst2"}
    for values in summary.values():
        assert set(values) == {
            "test_accuracy",
            "dev_accuracy",
            "C",
            "nonzero",
            "top_unit",
            "top_unit_accuracy",
            "baseline_test_accuracy",
        }
        assert 0 <= values["baseline_test_accuracy"] <= 1  # measured on the same splits
        assert 2**-8 <= values["C"] <= 4 and 0 <= values["top_unit"] < 64 and 0 < values["nonzero"] <= 64
    # The generated reviews' tone follows their stars, so even a tiny mLSTM's state separates them.
    assert summary["reviews"]["test_accuracy"] > 0.9, summary

    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(env["MLSTM_MLFLOW_TRACKING_URI"])
    client = MlflowClient()
    name = env["MLSTM_MODEL_NAME"]
    champion = client.get_model_version_by_alias(name, CHAMPION)
    assert champion.version == "1" and champion.tags["dataset"] == "reviews"
    run = client.get_run(champion.run_id)
    # Under the run that trained the checkpoint.
    checkpoint = load_checkpoint(trained["checkpoint"])
    assert run.data.tags["mlflow.parentRunId"] == checkpoint.meta["mlflow_run_id"]
    assert run.data.metrics["reviews_test_accuracy"] == pytest.approx(summary["reviews"]["test_accuracy"])
    assert {i.dataset.name for i in run.inputs.dataset_inputs} >= {"sst2-train", "sst2-dev", "sst2-test"}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "sst2")}
    assert {"sst2/accuracy_vs_C.png", "sst2/top_unit.png", "sst2/report.json", "sst2/neuron"} <= artifacts
    assert 6 <= len(client.list_artifacts(run.info.run_id, "sst2/neuron")) <= 8  # six extremes + mistakes

    # The logged model holds no pickle: weights as .npz, code as files.
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{name}@{CHAMPION}"))
    assert not list(local.rglob("*.pkl")) and list(local.rglob("classifier.npz"))
    requirements = (local / "requirements.txt").read_text()
    assert f"torch=={torch.__version__}" in requirements

    # Loaded by alias, it behaves: clearly positive and clearly negative texts get opposite labels.
    loaded = mlflow.pyfunc.load_model(f"models:/{name}@{CHAMPION}")
    import pandas as pd

    predicted = loaded.predict(pd.DataFrame({"text": [POSITIVE, NEGATIVE]}))
    assert list(predicted["label"]) == ["positive", "negative"], predicted

    # The same transfer again does not beat the champion: a new version, the alias stays.
    again = cli(["transfer", "--checkpoint", trained["checkpoint"], "--dataset", f"reviews={labelled}"], env)
    assert again.returncode == 0, again.stderr
    assert "does not beat champion v1" in again.stdout
    assert client.get_model_version_by_alias(name, CHAMPION).version == "1"
    assert client.get_model_version(name, "2").tags["promotion"].startswith("test accuracy")

    # `mlstm-sentiment predict` scores with the champion by default.
    scored = cli(["predict", POSITIVE, NEGATIVE, "--json"], env)
    assert scored.returncode == 0, scored.stderr
    lines = [json.loads(line) for line in scored.stdout.splitlines()]
    assert [line["label"] for line in lines] == ["positive", "negative"]
    assert lines[0]["probability"] > 0.5 > lines[1]["probability"]

    _serve_and_post(env, f"models:/{name}@{CHAMPION}", Path(env["MLSTM_HOME"]) / "logs" / "serve.log")


@pytest.mark.slow  # the module's `trained` fixture trains for about 30 s
def test_transfer_logs_the_neuron_over_the_extremes_and_the_mistakes(
    trained: dict[str, Any], mlflow_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The stage's functions without Prefect, on the trained model and a small labelled sample: the
    heatmaps of the three most positive, the three most negative and the two most confidently
    misclassified test reviews in the store and the MLflow run, each P the classifier's own, listed for
    the Prefect artifact; the registered classifier keeps its unit's class means for `generate`."""
    from mlflow.tracking import MlflowClient
    from PIL import Image

    from tasks.transfer.baseline import fit_baseline
    from tasks.transfer.datasets import load_dataset
    from tasks.transfer.explain import class_means
    from tasks.transfer.registry import heatmaps_markdown, log_report, open_transfer_run
    from tasks.transfer.stage import (
        TransferParams,
        classifier_of,
        extract,
        measure_baseline,
        probe,
        split_features,
    )

    monkeypatch.setenv("MLSTM_HOME", str(trained["home"]))
    monkeypatch.setenv("MLSTM_MLFLOW_TRACKING_URI", mlflow_server)
    settings = get_settings()
    small = write_labelled_sample(tmp_path / "small", num_reviews=150)
    params = TransferParams(
        checkpoint=trained["checkpoint"], datasets=[f"small={small}"], c_min_log2=-1, c_max_log2=1
    )
    extracted = extract(params, params.datasets[0], settings)
    # --precision bf16: the features are read in bf16 and kept in the cache apart from fp32's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a CPU that emulates bf16: slower, same values
        bf16 = extract(params.model_copy(update={"precision": "bf16"}), params.datasets[0], settings)
    assert [s.uri.rpartition("/")[2] for s in bf16.splits.values()] == [
        f"{split}.bf16.arrow" for split in extracted.splits
    ]
    report = probe(extracted, params, settings)
    # The TF-IDF baseline is measured on the same splits, once: a second transfer reads it from the store.
    measured = fit_baseline(load_dataset(params.datasets[0]))
    baseline = report.baseline
    assert baseline is not None and baseline.cached is False
    assert (baseline.test_accuracy, baseline.C) == (measured.test_accuracy, measured.C)
    again = measure_baseline(extracted.spec, extracted.checksum, params, settings)
    assert again.cached is True and again.test_accuracy == measured.test_accuracy
    heatmaps = report.heatmaps
    assert [h.role.split(",")[0] for h in heatmaps[:6]] == [
        *(f"positive {k}" for k in (1, 2, 3)),
        *(f"negative {k}" for k in (1, 2, 3)),
    ]
    import csv

    with (small / "test.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    texts, labels = [row["text"] for row in rows], np.array([int(row["label"]) for row in rows])
    classifier = classifier_of(report, settings)
    p_N = classifier.predict_proba(texts)
    for h in heatmaps:  # the heatmap's last probability is what the classifier says of the whole review
        assert h.probability == pytest.approx(p_N[h.row], abs=1e-5)
    others = np.delete(p_N, [h.row for h in heatmaps])
    assert min(h.probability for h in heatmaps[:3]) >= max(others)
    assert max(h.probability for h in heatmaps[3:6]) <= min(others)
    wrong_N = (p_N >= 0.5) != (labels == 1)
    surest = np.argsort(-np.abs(p_N - 0.5), kind="stable")
    mistakes = [int(i) for i in surest if wrong_N[i]][:2]
    assert set(mistakes) <= {h.row for h in heatmaps}  # the two most confident mistakes are shown
    # What `generate --sentiment positive|negative` holds the unit near: its class means on train.
    expected = class_means(*split_features(extracted, settings)["train"])
    assert classifier.class_means_2H is not None
    np.testing.assert_allclose(classifier.class_means_2H, expected, rtol=1e-6)

    run_id = open_transfer_run(None, settings, run_name="neuron", tags={})
    log_report(run_id, report, settings)
    client = MlflowClient()
    metrics = client.get_run(run_id).data.metrics
    # What the features were read in (auto on a CPU: fp32), in the report and on the run.
    assert report.features_precision == "fp32" and bf16.features_precision == "bf16"
    assert client.get_run(run_id).data.params["small.features_precision"] == "fp32"
    assert metrics["small_baseline_test_accuracy"] == pytest.approx(measured.test_accuracy)
    assert metrics["small_vs_baseline"] == pytest.approx(report.test_accuracy - measured.test_accuracy)
    logged = sorted(a.path for a in client.list_artifacts(run_id, "small/neuron"))
    assert logged == sorted(f"small/neuron/{h.uri.rsplit('/', 1)[-1]}" for h in heatmaps)
    with Image.open(client.download_artifacts(run_id, logged[0], str(tmp_path))) as image:
        assert image.size[0] > 200 and image.size[1] > 100
    markdown = heatmaps_markdown([report], lambda path: f"<{path}>")
    assert all(f"<{path}>" in markdown for path in logged)


def _serve_and_post(env: dict[str, str], model_uri: str, log: Path) -> None:
    """`mlflow models serve` as a user runs it, then POST /invocations."""
    with served(model_uri, env["MLSTM_MLFLOW_TRACKING_URI"], log=log, timeout=120) as url:
        predictions = invoke(url, [POSITIVE, NEGATIVE])
    assert [p["label"] for p in predictions] == ["positive", "negative"]
    assert predictions[0]["probability"] > 0.5 > predictions[1]["probability"]


def test_champion_moves_only_to_a_better_model_on_the_same_test_set(
    mlflow_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The promotion rule alone, on registered versions of a small logged model."""
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLSTM_MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLSTM_MODEL_NAME", "promotion-rule")
    settings = get_settings()
    mlflow.set_tracking_uri(mlflow_server)

    @mlflow.pyfunc.utils.pyfunc  # checks inputs against the type hints, as MLflow asks a function model to
    def echo(model_input: list[str]) -> list[str]:
        return model_input

    with mlflow.start_run():
        model_uri = mlflow.pyfunc.log_model(
            name="model", python_model=echo, pip_requirements=["mlflow"]
        ).model_uri

    baseline = BaselineReport(
        test_accuracy=0.655, dev_accuracy=0.6, C=2.0, seconds=1.0, method="tf-idf", cached=True
    )

    def report(accuracy: float, checksum: str = "a" * 64) -> ProbeReport:
        return probe_report(name="sst2", checksum=checksum, test_accuracy=accuracy, baseline=baseline)

    def register(model_uri: str, report: ProbeReport, settings: Settings, **options: Any) -> Registration:
        return registry.register(model_uri, report, settings, description=model_card(report), **options)

    scored: list[str] = []

    def score(uri: str) -> float:
        scored.append(uri)
        return 0.80

    first = register(model_uri, report(0.70), settings, score_on_test=score)
    assert first.promoted and first.reason == "there was no champion"
    # The model card (the version's description) puts the probe beside the measured baseline.
    card = MlflowClient(mlflow_server).get_model_version("promotion-rule", str(first.version))
    assert "70.00% vs baseline 65.50% (+4.50 points)" in card.description
    assert card.tags["baseline_test_accuracy"] == "0.655000"
    worse = register(model_uri, report(0.69), settings, score_on_test=score)
    tie = register(model_uri, report(0.70), settings, score_on_test=score)
    better = register(model_uri, report(0.71), settings, score_on_test=score)
    assert [worse.promoted, tie.promoted, better.promoted] == [False, False, True]
    assert scored == []  # same test set: the champion's recorded accuracy is compared, nothing re-run
    # Another test set: the champion is scored on ours (0.80 here), and 0.75 does not beat it.
    other = register(model_uri, report(0.75, checksum="b" * 64), settings, score_on_test=score)
    assert scored == ["models:/promotion-rule@champion"] and not other.promoted
    champion = MlflowClient(mlflow_server).get_model_version_by_alias("promotion-rule", CHAMPION)
    assert str(champion.version) == str(better.version)


def test_saved_classifier_loads_without_pickles_and_predicts_the_same(tmp_path: Path) -> None:
    from models.mlstm import MLSTM, tiny

    torch.manual_seed(0)
    classifier = SentimentClassifier(
        MLSTM(tiny()), np.random.default_rng(0).normal(size=64), 0.1, {"dataset": "x"}
    )
    folder = classifier.save(tmp_path / "c")
    with np.load(folder / "classifier.npz", allow_pickle=False) as arrays:
        assert "probe.coef" in arrays.files
    loaded = SentimentClassifier.load(folder)
    texts = ["short", "a somewhat longer text &amp; more", ""]
    np.testing.assert_allclose(loaded.predict_proba(texts), classifier.predict_proba(texts), rtol=1e-6)
    assert loaded.info == {"dataset": "x"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dataset", "sst2=/nowhere"], "/nowhere: no such file or folder"),
        (["--dataset", "a={labelled}", "--dataset", "a={labelled}"], "dataset names must differ"),
        (["--dataset", "a={labelled}", "--register", "b"], "--register 'b' is not one of the datasets (a)"),
        (["--dataset", "a={labelled}", "--c-min-log2", "3"], "c_min_log2 3 is above c_max_log2 2"),
    ],
)
def test_bad_transfer_flags_fail_before_any_work(
    flags: list[str], message: str, labelled: Path, home: Path, tmp_path: Path
) -> None:
    flags = [f.format(labelled=labelled) for f in flags]
    result = cli_in_process(
        ["transfer", "--checkpoint", str(tmp_path / "none"), *flags], {"MLSTM_HOME": str(home)}
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (home / "store").exists()


def test_a_champion_scored_on_other_data_is_rescored_here_and_an_unreadable_one_replaced(
    mlflow_server: str,
    labelled: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The two branches of the rule that run the champion: a real classifier, scored on this test split
    by ``accuracy_on_test``, then the same champion with its artifacts gone."""
    import shutil

    import mlflow
    from mlflow.tracking import MlflowClient

    from models.mlstm import MLSTM, tiny
    from tasks.transfer.datasets import load_dataset
    from tasks.transfer.stage import TransferParams, accuracy_on_test

    monkeypatch.setenv("MLSTM_MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLSTM_MODEL_NAME", "rescored-champion")
    settings = get_settings()
    mlflow.set_tracking_uri(mlflow_server)
    client = MlflowClient()
    torch.manual_seed(0)
    classifier = SentimentClassifier(MLSTM(tiny()), np.random.default_rng(1).normal(size=64), 0.0, {})
    run_id = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    model_uri = log_classifier(run_id, classifier, "classifier")

    spec = f"reviews={labelled}"
    test = load_dataset(spec).test
    expected = float(((classifier.predict_proba(test.texts) >= 0.5) == test.labels).mean())
    params = TransferParams(checkpoint="unused", datasets=[spec])

    def score(uri: str) -> float:
        return accuracy_on_test(uri, spec, params)

    def report(accuracy: float, checksum: str) -> ProbeReport:
        return probe_report(name="reviews", checksum=checksum, test_accuracy=accuracy)

    def register(model_uri: str, report: ProbeReport, settings: Settings, **options: Any) -> Registration:
        return registry.register(model_uri, report, settings, description="a card", **options)

    first = register(model_uri, report(0.99, "a" * 64), settings, score_on_test=score)
    assert first.promoted
    # Scored on other data: its 0.99 says nothing here; run on this test split it scores `expected`.
    below = register(model_uri, report(expected, "b" * 64), settings, score_on_test=score)
    assert below.champion_accuracy == pytest.approx(expected) and not below.promoted, below
    above = register(model_uri, report(expected + 0.01, "b" * 64), settings, score_on_test=score)
    assert above.promoted and above.champion_version == first.version, above

    # The champion's files are gone (a cleaned bucket): it cannot be scored, and it cannot serve either.
    model_id = model_uri.removeprefix("models:/")  # every version here is this one logged model
    server_root = next(tmp_path_factory.getbasetemp().glob("mlflow-server*"))
    folders = [p for p in (server_root / "artifacts").rglob(model_id) if p.is_dir()]
    assert model_id.startswith("m-") and folders, (model_id, folders)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    replaced = register(model_uri, report(0.5, "c" * 64), settings, score_on_test=score)
    assert replaced.promoted and replaced.champion_accuracy is None
    assert replaced.reason.startswith(f"champion v{above.version} could not be scored on reviews ("), replaced
    assert "\n" not in replaced.reason
    version = client.get_model_version("rescored-champion", str(replaced.version))
    assert version.tags["promotion"] == replaced.reason
    assert client.get_model_version_by_alias("rescored-champion", CHAMPION).version == str(replaced.version)
