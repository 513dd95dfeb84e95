"""`mlstm-sentiment explain` and `generate` against a classifier logged to a real MLflow server."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_in_process

from models.classifier import SentimentClassifier
from models.features import featurize
from models.mlstm import MLSTM, tiny
from models.neuron import generate
from models.text import FRONT_PAD
from tasks.jobs.checkpoint import save_checkpoint, step_prefix
from tasks.store import LocalStore

CLI = str(Path(sys.executable).with_name("mlstm-sentiment"))


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["explain", "   "], "text 1 is empty or only whitespace"),
        (["explain", "ok", "--out", "x.pdf"], "give a .png or .html file"),
        (["explain", ""], "text 1 is empty or only whitespace"),
        (["generate", "--length", "0"], "'--length'"),
        (["generate", "--length", "-3"], "'--length'"),
        (["generate", "--length", "100000000"], "'--length'"),
        (["generate", "--samples", "100000000"], "'--samples'"),
        (["generate", "--sentiment", "1e308"], "a cell value within ±1000"),
        (["explain", "x" * 20_001], "text 1 has 20,001 characters, more than 20,000 (MLSTM_MAX_TEXT_CHARS)"),
        (["generate", "--temperature", "-1"], "0 for greedy"),
        (["generate", "--sentiment", "happy"], "give positive, negative or a cell value"),
        (["generate", "--sentiment", "nan"], "give positive, negative or a cell value"),
        (["generate", "--temperature", "nan"], "0 for greedy"),
        (["explain", "ok", "--checkpoint", "runs/r"], "--unit N is required with --checkpoint"),
        (["explain", "ok", "--checkpoint", "runs/r", "--model", "models:/m@c", "--unit", "1"], "not both"),
        (["generate", "--checkpoint", "runs/r", "--model", "models:/m@c"], "not both"),
        (
            ["generate", "--checkpoint", "runs/r", "--sentiment", "positive"],
            "needs a probe (a registered --model)",
        ),
        (["generate", "--checkpoint", "runs/r", "--sentiment", "1.5"], "with --checkpoint needs --unit N"),
    ],
)
def test_bad_input_is_one_line_before_any_work(args: list[str], message: str, home: Path) -> None:
    """In this process (an exception that escapes the command fails the test as a traceback would fail
    the user): the same code as the command line's, without an interpreter start each."""
    result = cli_in_process(args, {"MLSTM_HOME": str(home)})
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_non_utf8_file_names_the_byte(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "review.txt"
    path.write_bytes(b"fine \xff")
    result = cli(["explain", "--input", str(path)], {**os.environ, "MLSTM_HOME": str(home)})
    assert f"{path}: not UTF-8 at byte 5" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.long  # about 80 s; the checkpoint test below runs the same commands in make test
def test_explain_and_generate_on_a_registered_model(mlflow_server: str, tmp_path: Path) -> None:
    import mlflow

    from tasks.transfer.registry import log_classifier

    torch.manual_seed(0)
    classifier = SentimentClassifier(MLSTM(tiny()), np.random.default_rng(0).normal(size=64), 0.1)
    mlflow.set_tracking_uri(mlflow_server)
    with mlflow.start_run() as run:
        pass
    uri = log_classifier(run.info.run_id, classifier, "classifier")
    env = {**os.environ, "MLSTM_HOME": str(tmp_path), "MLSTM_MLFLOW_TRACKING_URI": mlflow_server}

    text = "Works well ☕ <b>"
    explained = cli(["explain", text, "--model", uri, "--json", "--out", str(tmp_path / "x.html")], env)
    assert explained.returncode == 0, explained.stderr
    reading = json.loads(explained.stdout)
    assert reading["unit"] == int(np.argmax(np.abs(classifier.coef_H)))
    assert reading["final"] == pytest.approx(float(classifier.predict_proba([text])[0]), abs=1e-5)
    page = (tmp_path / "x.html").read_text()
    assert "<b>" not in page and "&gt;" in page

    args = ["generate", "--model", uri, "--sentiment", "2", "--length", "20", "--samples", "2", "--json"]
    first, again, other = (cli([*args, "--seed", s], env) for s in ("1", "1", "2"))
    assert first.returncode == 0, first.stderr
    samples = json.loads(first.stdout)
    assert samples["value"] == 2.0 and len(samples["samples"]) == 2
    assert first.stdout == again.stdout and first.stdout != other.stdout

    # predict --explain: the same per-byte view as explain, from the served model's own classifier.
    predicted = cli(["predict", text, "--model", uri, "--explain", "--json"], env)
    assert predicted.returncode == 0, predicted.stderr
    line = json.loads(predicted.stdout)
    assert line["explain"] == reading and line["probability"] == pytest.approx(reading["final"], abs=1e-5)
    shown = cli(["predict", text, "--model", uri, "--explain"], env)
    assert f"unit {reading['unit']} · final P(positive) = {reading['final']:.3f}" in shown.stdout

    outside = cli(["explain", "ok", "--model", uri, "--unit", "64"], env)
    assert outside.returncode != 0 and "unit 64 is outside the model's 64 units" in outside.stderr
    assert "Traceback" not in outside.stderr
    missing = cli(["explain", "ok", "--model", "models:/no-such-model@champion"], env)
    assert missing.returncode != 0 and "cannot load models:/no-such-model@champion" in missing.stderr
    assert "Traceback" not in missing.stderr


def _save_model(store: LocalStore, step: int, seed: int) -> MLSTM:
    """A tiny random mLSTM saved as the training job saves one (no training: its weights are the seed's)."""
    torch.manual_seed(seed)
    model = MLSTM(tiny())
    save_checkpoint(
        store, "r", step, {"model": model.state_dict()}, {"model": dataclasses.asdict(model.config)}
    )
    return model


@pytest.mark.slow
def test_explain_and_generate_on_a_checkpoint(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    intact = _save_model(store, 10, seed=1)
    _save_model(store, 20, seed=2)
    state = tmp_path / "store" / step_prefix("r", 20) / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # a copy cut short: the run folder falls back to step 10
    run = str(tmp_path / "store" / "runs" / "r")
    env = {**os.environ, "MLSTM_HOME": str(tmp_path)}

    text = "Broke after a week ☕"
    explained = cli(["explain", text, "--checkpoint", run, "--unit", "7", "--json"], env)
    assert explained.returncode == 0, explained.stderr
    reading = json.loads(explained.stdout)
    assert set(reading) == {"text", "unit", "values", "probability", "final"}
    assert reading["unit"] == 7 and reading["probability"] is None and reading["final"] is None
    assert len(reading["values"]) == len(reading["text"])  # one value per character
    # The value after the last byte is the feature the features path gives, of the intact step's weights.
    assert reading["values"][-1] == pytest.approx(float(featurize(intact, [text])[0, 7]), abs=1e-5)
    # The rest in this process (the command's own code through Typer's runner): a new interpreter for
    # each would import torch, Prefect and MLflow again, about 5 s of CPU a command.
    home: dict[str, str | None] = {"MLSTM_HOME": str(tmp_path)}
    shown = cli_in_process(["explain", text, "--checkpoint", run, "--unit", "7"], home)
    assert shown.returncode == 0 and "P(positive)" not in shown.stdout and "unit 7" in shown.stdout

    args = ["generate", "--checkpoint", run, "--unit", "5", "--sentiment", "2.5", "--length", "30"]
    args += ["--samples", "2", "--prompt", "It", "--json"]
    first, again, other = (cli_in_process([*args, "--seed", s], home) for s in ("1", "1", "2"))
    assert first.returncode == 0, first.stderr
    written = json.loads(first.stdout)
    assert written["unit"] == 5 and written["value"] == 2.5
    assert [row["probability"] for row in written["samples"]] == [None, None]
    assert first.stdout == again.stdout and first.stdout != other.stdout
    # What it printed is what the model writes with unit 5 held at 2.5, which holds it at every step.
    kwargs = {"length": 30, "temperature": 0.4, "samples": 2, "seed": 1, "unit": 5, "value": 2.5}
    texts, held = generate(intact, (FRONT_PAD + "It").encode(), **kwargs)  # type: ignore[arg-type]
    assert [row["text"] for row in written["samples"]] == ["It" + t.decode("utf-8", "replace") for t in texts]
    assert np.all(held == np.float32(2.5))


@pytest.mark.long
@pytest.mark.timeout(1800)  # the reference cell steps a million bytes one at a time on shared cores
def test_a_megabyte_review_is_read_in_chunks_and_the_png_says_what_it_cuts(tmp_path: Path) -> None:
    """1 MB from a file, with MLSTM_MAX_TEXT_CHARS raised to allow it (the default refuses texts past
    20,000 characters): every character read, the PNG capped at its rows with a line saying so. Minutes
    on a CPU: the reference cell steps per byte (chunked reading equals one pass: test_neuron.py)."""
    store = LocalStore(tmp_path / "store")
    _save_model(store, 10, seed=1)
    review = "Great kettle, boils fast. Then it leaked — avoid ☕.\n"
    text = review * (2**20 // len(review.encode()) + 1)
    path = tmp_path / "review.txt"
    path.write_text(text, encoding="utf-8")
    run = str(tmp_path / "store" / "runs" / "r")
    env = {**os.environ, "MLSTM_HOME": str(tmp_path), "MLSTM_MAX_TEXT_CHARS": str(len(text))}
    png = tmp_path / "big.png"
    result = cli(
        ["explain", "--input", str(path), "--checkpoint", run, "--unit", "3", "--json", "--out", str(png)],
        env,
    )
    assert result.returncode == 0, result.stderr
    reading = json.loads(result.stdout)
    assert len(reading["values"]) == len(reading["text"]) > 10**6 // 2
    assert "the PNG shows the first 60 of" in result.stderr and f"wrote {png}" in result.stderr
    from PIL import Image

    with Image.open(png) as image:
        assert image.size[1] < 4000  # capped: 60 rows, not the text's thousands
