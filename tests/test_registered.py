"""A registered classifier is read as data by the project's readers (tasks/registered.py): an artifact
whose MLmodel names a loader shipped in its code/ folder, or a pickled python model, runs nothing here;
with a key set, its files are refused when changed or unsigned."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

TEXTS = ["Absolutely love it, five stars.", "Broke in a day. Refund please."]

EVIL_LOADER = """
from pathlib import Path
def _load_pyfunc(data_path):
    Path({marker!r}).write_text("ran")
    raise SystemExit("the artifact's own code ran")
"""


class Payload:
    """A harmless stand-in for an attacker's pickled python model: unpickling it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def register(home: Path, monkeypatch: pytest.MonkeyPatch, *, key: str | None = None) -> tuple[Any, str]:
    """A tiny probe classifier logged and registered in ``home``; the classifier and its version's URI."""
    import mlflow
    import torch

    from models.classifier import SentimentClassifier
    from models.mlstm import MLSTM, tiny
    from tasks.settings import get_settings
    from tasks.tracking import connect
    from tasks.transfer.registry import log_classifier

    monkeypatch.setenv("MLSTM_HOME", str(home))
    if key is not None:
        monkeypatch.setenv("MLSTM_CHECKPOINT_KEY", key)
    settings = get_settings()
    connect(settings)
    torch.manual_seed(0)
    classifier = SentimentClassifier(MLSTM(tiny()), np.random.default_rng(0).normal(size=64), 0.1)
    with mlflow.start_run() as run:
        pass
    uri = log_classifier(run.info.run_id, classifier, "classifier")
    version = mlflow.register_model(uri, settings.model_name)
    return classifier, f"models:/{settings.model_name}/{version.version}"


def artifact_of(home: Path) -> Path:
    """The stored artifact folder (the one holding MLmodel) of the one model logged in ``home``: what a
    writer of the artifact root can change."""
    [mlmodel] = [p for p in home.rglob("MLmodel") if "cache" not in p.relative_to(home).parts]
    return mlmodel.parent


def read(uri: str) -> Any:
    from tasks import registered
    from tasks.settings import get_settings

    return registered.load(registered.resolve(uri, get_settings()))


def test_a_registered_classifier_reads_as_it_predicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    classifier, uri = register(tmp_path / "home", monkeypatch)
    served = read(uri)
    expected = classifier.predict_proba(TEXTS)
    # A model named by its folder is fetched afresh into one cache folder, not a new copy a read.
    for _ in range(2):
        by_folder = read(str(artifact_of(tmp_path / "home")))
    assert len(list((tmp_path / "home" / "cache" / "models").glob("uri-*"))) == 1
    np.testing.assert_allclose(
        by_folder.predict(pd.DataFrame({"text": TEXTS}))["probability"], expected, rtol=1e-5
    )
    np.testing.assert_allclose(
        served.predict(pd.DataFrame({"text": TEXTS}))["probability"], expected, rtol=1e-5
    )


@pytest.mark.parametrize("forgery", ["loader in code/", "model from code", "pickled python model"])
def test_an_artifact_that_names_its_own_code_runs_nothing_here(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, forgery: str
) -> None:
    import mlflow.pyfunc

    classifier, uri = register(tmp_path / "home", monkeypatch)
    artifact = artifact_of(tmp_path / "home")
    marker = tmp_path / "ran"
    mlmodel = yaml.safe_load((artifact / "MLmodel").read_text())
    flavour = mlmodel["flavors"]["python_function"]
    if forgery == "loader in code/":
        (artifact / "code").mkdir()
        (artifact / "code" / "evil_loader.py").write_text(EVIL_LOADER.format(marker=str(marker)))
        flavour["loader_module"], flavour["code"] = "evil_loader", "code"
    elif forgery == "model from code":
        # MLflow's models-from-code: its loader executes the file the flavour names.
        (artifact / "model.py").write_text(f"open({str(marker)!r}, 'w')\n")
        flavour["loader_module"], flavour["model_code_path"] = "mlflow.pyfunc.model", "model.py"
        del flavour["data"]  # MLflow's loader reads the model's root
    else:
        import pickle

        # MLflow 3 unpickles a python model only where this is set (a host serving older models may).
        monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
        (artifact / "python_model.pkl").write_bytes(pickle.dumps(Payload(marker)))
        # What mlflow.pyfunc.log_model(python_model=…) writes: MLflow's own loader unpickles the model.
        flavour["loader_module"], flavour["python_model"] = "mlflow.pyfunc.model", "python_model.pkl"
        del flavour["data"]
        flavour["cloudpickle_version"] = "3.0.0"
    (artifact / "MLmodel").write_text(yaml.safe_dump(mlmodel))

    # The attack is real: MLflow's own loader follows MLmodel and runs it.
    with contextlib.suppress(BaseException):  # whatever the payload makes of the load afterwards
        mlflow.pyfunc.load_model(str(artifact))
    assert marker.exists()
    marker.unlink()

    # The project's reader: the package's code on the artifact's data, or one line refusing an artifact
    # that names no data folder; the artifact's own code never runs.
    if "data" in flavour:
        served = read(uri)
        np.testing.assert_allclose(
            served.predict(pd.DataFrame({"text": TEXTS}))["probability"],
            classifier.predict_proba(TEXTS),
            rtol=1e-5,
        )
    else:
        from tasks.registered import ModelNotFound

        with pytest.raises(ModelNotFound, match="is not a classifier this project logged"):
            read(uri)
    assert not marker.exists()


def test_changed_or_unsigned_files_are_refused_with_no_key_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signed by default: with no MLSTM_CHECKPOINT_KEY, under the key made in the home."""
    from tasks import registered

    home = tmp_path / "home"
    monkeypatch.delenv("MLSTM_CHECKPOINT_KEY")
    _, uri = register(home, monkeypatch)
    read(uri)  # signed when logged, and read back
    artifact = artifact_of(home)
    data = next(artifact.rglob("classifier.json")).parent
    weights = data / "classifier.npz"
    with np.load(weights) as arrays:
        changed = {name: arrays[name] for name in arrays.files}
    changed["probe.intercept"] = changed["probe.intercept"] + 5.0
    np.savez(weights, **changed)
    shutil.rmtree(home / "cache")  # a fresh reader downloads the stored files again
    with pytest.raises(registered.UntrustedModel, match=r"classifier\.npz changed since it was signed"):
        read(uri)

    (data / registered.SIGNATURE_FILE).write_text(json.dumps({"sha256": {}}))
    shutil.rmtree(home / "cache")
    with pytest.raises(registered.UntrustedModel, match="is not signed: not read"):
        read(uri)
