"""The served classifier (issue 19): its artifacts stay under MLSTM_HOME, the serve command works as
printed, and the served model refuses what it should not score with a 400 that names the row or limit.

One model, logged and registered from an empty folder into the embedded SQLite store; one
`mlflow models serve` started by running the printed command itself, with a PATH that has no
virtual environment on it, for every request below.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks.settings import Settings
from tasks.transfer.serve import _free_port, serve_command

BIN = Path(sys.executable).parent
LIMIT = 5_000  # MLSTM_MAX_TEXT_CHARS when the model is logged; the server's environment does not have it
CLEAN_PATH = "/usr/bin:/bin"  # no virtual environment on it
USER_HOME = Path(tempfile.mkdtemp(prefix="serving-user-home-"))  # the served command's $HOME

LOG_AND_REGISTER = """
import mlflow, numpy as np, torch
from mlflow.tracking import MlflowClient
from models.classifier import SentimentClassifier
from models.mlstm import MLSTM, tiny
from tasks.settings import get_settings
from tasks.tracking import connect
from tasks.transfer.registry import log_classifier

settings = get_settings()
connect(settings)
torch.manual_seed(0)
classifier = SentimentClassifier(MLSTM(tiny()), np.random.default_rng(0).normal(size=64), 0.1)
with mlflow.start_run() as run:
    pass
uri = log_classifier(run.info.run_id, classifier, "classifier")
version = mlflow.register_model(uri, settings.model_name)
MlflowClient().set_registered_model_alias(settings.model_name, "champion", version.version)
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any MLflow or MLSTM setting that would point elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MLSTM_"))}
    return {**env, "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny classifier logged and made champion by a process started in an empty folder."""
    home = tmp_path_factory.mktemp("serving-home")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    done = subprocess.run(
        [sys.executable, "-c", LOG_AND_REGISTER],
        cwd=elsewhere,
        env=_clean_env(MLSTM_HOME=str(home), MLSTM_MAX_TEXT_CHARS=str(LIMIT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return {"home": home, "elsewhere": elsewhere}


@pytest.fixture(scope="module")
def server(registered: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The printed serve command, run exactly as printed by a shell with a clean PATH, from another folder."""
    settings = Settings(home=registered["home"])
    port = _free_port()
    command = serve_command(
        "models:/mlstm-sentiment@champion", settings.resolved_mlflow_tracking_uri, port=port
    )
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=tmp_path_factory.mktemp("serve-cwd"),
            # A user's shell: no MLflow settings of its own, and a home the test can look into (and the
            # code under test where it is not the installed package's).
            env={"PATH": CLEAN_PATH, "HOME": str(USER_HOME), **_python_path()},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"`{command}` exited {process.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _python_path() -> dict[str, str]:
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


def _post(url: str, body: Any, *, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}/invocations", content=content, headers=headers, timeout=120)


def _records(*texts: Any) -> dict[str, Any]:
    return {"dataframe_records": [{"text": text} for text in texts]}


@pytest.mark.slow
def test_a_model_logged_from_another_folder_keeps_its_files_under_mlstm_home(
    registered: dict[str, Path],
) -> None:
    assert list(registered["elsewhere"].iterdir()) == []  # no ./mlruns, no mlflow.db
    artifacts = registered["home"] / "mlartifacts"
    assert list(artifacts.rglob("classifier.npz")), sorted(registered["home"].rglob("*"))
    saved = json.loads(next(artifacts.rglob("classifier.json")).read_text())
    assert saved["max_text_chars"] == LIMIT
    # No code travels with the model: whoever writes the artifact store changes data, not what runs.
    assert not [p for p in artifacts.rglob("*") if p.suffix in (".py", ".pyc", ".pkl")]
    mlmodel = next(artifacts.rglob("MLmodel")).read_text()
    assert "loader_module: models.mlflow_loader" in mlmodel and "code: null" in mlmodel, mlmodel


def test_a_model_logged_by_a_newer_package_is_refused_by_name(tmp_path: Path) -> None:
    import numpy as np

    from models.classifier import SentimentClassifier
    from models.mlflow_loader import VERSION_KEY, _load_pyfunc, installed_version
    from models.mlstm import MLSTM, tiny

    model = MLSTM(tiny())
    probe = SentimentClassifier(
        model, np.zeros(model.config.hidden_size, np.float32), 0.0, {VERSION_KEY: "99.0"}
    )
    folder = probe.save(tmp_path / "classifier")
    with pytest.raises(
        RuntimeError, match=f"logged by mlstm-sentiment 99.0, newer than the installed {installed_version()}"
    ):
        _load_pyfunc(str(folder))
    json_file = folder / "classifier.json"
    json_file.write_text(json_file.read_text().replace('"99.0"', f'"{installed_version()}"'))
    assert _load_pyfunc(str(folder)).classifier.info[VERSION_KEY] == installed_version()


def test_every_request_format_refuses_a_text_that_is_not_a_string(server: str) -> None:
    """MLflow casts an ``inputs``/``instances`` request's texts to strings before the model sees them:
    the served model refuses them as sent, naming the item, as ``dataframe_records`` does."""
    for body, message in [
        ({"inputs": {"text": [5]}}, "inputs: row 1: 'text' must be a string, got int 5"),
        ({"inputs": {"text": [None]}}, "inputs: row 1: 'text' must be a string, got NoneType None"),
        ({"inputs": {"text": [True]}}, "inputs: row 1: 'text' must be a string, got bool True"),
        ({"inputs": {"text": [{"a": 1}]}}, "inputs: row 1: 'text' must be a string, got dict {'a': 1}"),
        ({"inputs": {"text": ["fine", 5]}}, "inputs: row 2: 'text' must be a string, got int 5"),
        ({"inputs": ["fine", None]}, "inputs: row 2: 'text' must be a string, got NoneType None"),
        ({"inputs": [{"text": "fine"}, {"text": 7}]}, "inputs: row 2: 'text' must be a string, got int 7"),
        ({"instances": ["fine", False]}, "instances: row 2: 'text' must be a string, got bool False"),
        (_records("fine", None), "row 2: 'text' must be a string"),
    ]:
        refused = _post(server, body)
        assert refused.status_code == 400, (body, refused.text)
        assert message in refused.json()["message"] and "stack_trace" not in refused.json(), (
            body,
            refused.text,
        )
    for body, rows in [
        ({"inputs": {"text": ["fine", "5"]}}, 2),
        ({"inputs": ["fine"]}, 1),
        ({"instances": [{"text": "fine"}]}, 1),
    ]:
        scored = _post(server, body)
        assert scored.status_code == 200 and len(scored.json()["predictions"]) == rows, (body, scored.text)


@pytest.mark.slow
def test_the_printed_command_writes_nothing_in_the_users_home(server: str) -> None:
    # MLflow keeps a telemetry id in ~/.config/mlflow unless told not to: the printed command tells it.
    assert httpx.get(f"{server}/ping", timeout=10).status_code == 200
    assert sorted(p.relative_to(USER_HOME) for p in USER_HOME.rglob("*")) == []


def test_the_printed_command_serves_and_refuses_bad_texts_by_row(server: str) -> None:
    scored = _post(server, _records("Absolutely love it!", "Broke in a day."))
    assert scored.status_code == 200, scored.text
    predictions = scored.json()["predictions"]
    assert len(predictions) == 2 and all(0.0 <= p["probability"] <= 1.0 for p in predictions)

    started = time.monotonic()
    huge = _post(server, _records("fine", "x" * 5_000_000))
    assert huge.status_code == 400, huge.text[:500]
    assert f"row 2: 'text' has 5,000,000 characters, more than this model's limit of {LIMIT:,}" in huge.text
    assert time.monotonic() - started < 55  # refused, not read until the server's 60 s timeout
    at_limit = _post(server, _records("y" * LIMIT))
    assert at_limit.status_code == 200, at_limit.text[:500]

    for body, message in [
        (_records("fine", 5), "row 2: 'text' must be a string"),
        (_records(""), "row 1: 'text' is empty"),
        (_records("fine", "fine", "   "), "row 3: 'text' is empty"),
    ]:
        refused = _post(server, body)
        assert refused.status_code == 400, (body, refused.text)
        assert message in refused.text, (body, refused.text)

    # The products in bf16 when a request asks (the parameter is in the logged signature, or MLflow
    # would drop it): near fp32's answer, not equal to it.
    texts = _records("Absolutely love it!", "Broke in a day.", "Fine, I guess.")
    exact = [p["probability"] for p in _post(server, texts).json()["predictions"]]
    in_bf16 = _post(server, {**texts, "params": {"precision": "bf16"}})
    assert in_bf16.status_code == 200, in_bf16.text
    approximate = [p["probability"] for p in in_bf16.json()["predictions"]]
    assert approximate != exact and approximate == pytest.approx(exact, abs=0.02)

    # Bad parameters: one line, and nothing of the server's code or paths.
    refused = _post(server, {**_records("fine"), "params": {"precision": "fp8"}})
    assert refused.status_code == 400, refused.text
    assert "'precision' must be one of auto, bf16, fp16, fp32, got 'fp8'" in refused.json()["message"]
    for batch_size in (0, -5, 10**9):
        refused = _post(server, {**_records("fine"), "params": {"batch_size": batch_size}})
        assert refused.status_code == 400, (batch_size, refused.text)
        answer = refused.json()
        assert "'batch_size' must be a whole number from 1 to" in answer["message"], answer
        assert "stack_trace" not in answer and "/" not in answer["message"], answer

    # A missing text column, no rows, a body that is not JSON: each a 400 as well.
    for body, raw in [
        ({"dataframe_records": [{"review": "fine"}]}, None),
        ({"dataframe_records": []}, None),
        (None, b'{"dataframe_records": [{"text": "fine"}'),
    ]:
        refused = _post(server, body, raw=raw)
        assert refused.status_code == 400, (body, raw, refused.text)
        if body and body["dataframe_records"]:  # the signature's refusal: a message, no stack trace
            assert "text" in refused.json()["message"] and "stack_trace" not in refused.json()


@pytest.mark.slow
def test_predict_applies_the_limit_stored_with_the_model(registered: dict[str, Path]) -> None:
    done = subprocess.run(
        [str(BIN / "mlstm-sentiment"), "predict", "fine", "z" * (LIMIT + 1)],
        env=_clean_env(MLSTM_HOME=str(registered["home"])),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert f"row 2: 'text' has {LIMIT + 1:,} characters, more than this model's limit of {LIMIT:,}" in message
    assert "Traceback" not in done.stderr


def test_predict_reads_in_the_asked_precision_a_model_logged_before_it_was_a_parameter(
    tmp_path: Path,
) -> None:
    # A model whose logged signature knows batch_size only: MLflow drops `precision` from its params with
    # a warning, so through MLflow `predict --precision bf16` would silently read fp32; the project reads
    # the model itself (tasks/registered.py), so the asked precision is honoured.
    import mlflow
    import numpy as np
    import pandas as pd
    import torch
    from mlflow.models import infer_signature

    from flows.cli.predict import _predicted
    from models import mlflow_loader
    from models.classifier import SentimentClassifier
    from models.mlstm import MLSTM, tiny
    from tasks import registered

    torch.manual_seed(0)
    model = MLSTM(tiny())
    probe = SentimentClassifier(model, np.random.default_rng(0).normal(size=model.config.hidden_size), 0.1)
    texts = ["Absolutely love it!", "Broke in a day.", "Fine, I guess."]
    frame = pd.DataFrame({"text": texts})
    signature = infer_signature(
        frame, pd.DataFrame({"label": ["a"], "probability": [0.5]}), params={"batch_size": 64}
    )
    data = probe.save(tmp_path / "classifier")
    registered.sign_folder(data)  # as the registry signs what it logs
    mlflow.pyfunc.save_model(
        tmp_path / "model",
        loader_module=mlflow_loader.__name__,
        data_path=str(data),
        signature=signature,
    )
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    exact = loaded.predict(frame, params={"batch_size": 8})["probability"].to_numpy()
    dropped = loaded.predict(frame, params={"batch_size": 8, "precision": "bf16"})["probability"].to_numpy()
    np.testing.assert_array_equal(dropped, exact)  # what MLflow alone does with it
    ours = registered.load(
        registered.RegisteredModel(uri="model", folder=registered.data_folder(tmp_path / "model", "model"))
    )
    asked = _predicted(ours, texts, {"batch_size": 8, "precision": "bf16"})["probability"].to_numpy()
    assert not np.array_equal(asked, exact)
    np.testing.assert_allclose(asked, exact, atol=0.02)
    np.testing.assert_array_equal(_predicted(ours, texts, {"batch_size": 8})["probability"], exact)
