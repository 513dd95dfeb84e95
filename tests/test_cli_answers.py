"""The CLI refuses bad input and answers help without loading what the work needs: no torch, Prefect,
MLflow or scikit-learn is imported to say that a flag, a stage or a file is wrong (each costs seconds on a
small machine; benchmarks/cli.py times them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "prefect", "mlflow", "sklearn", "pyarrow", "boto3")
CASES = {
    "help": (["--help"], 0, "pretrain"),
    "a stage's help": (["pretrain", "--help"], 0, "--batch-size"),
    "a bad flag": (["pretrain", "--corpus", "c", "--bogus"], 2, "No such option"),
    "a bad flag of run": (["run", "pretrain", "--bogus"], 2, "No such option"),
    "a bad stage": (["run", "nosuch"], 2, "unknown stage 'nosuch'"),
    "a bad pipeline setting": (
        ["run", "pretrain", "--set", "pretrain.batch_size=0"],
        2,
        "pretrain.batch_size",
    ),
    "a bad choice": (["pretrain", "--corpus", "c", "--precision", "fp8"], 2, "fp8"),
    "a bad setting": (["pretrain", "--corpus", "c", "--batch-size", "0"], 2, "--batch-size"),
    "an infinite lr": (["pretrain", "--corpus", "c", "--lr", "inf"], 2, "should be a finite number"),
    "an unknown preset": (["pretrain", "--corpus", "c", "--preset", "huge"], 2, "choose one of tiny"),
    "a missing corpus": (["pretrain", "--corpus", "/nonexistent/manifest.json"], 2, "no corpus manifest"),
    "status before anything ran": (["status"], 0, "no pipeline runs yet"),
    "score's help": (["score", "--help"], 0, "--id-column"),
    "a missing score input": (["score", "/nonexistent/reviews.csv", "--output", "out"], 2, "no such file"),
}


def answer(arguments: list[str], home: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the CLI as a user does, in a fresh home; the result and the heavy packages it imported."""
    env = {**os.environ, "MLSTM_HOME": str(home), "COLUMNS": "200"}
    for name in ("MLSTM_STORE_URI", "MLSTM_MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from flows.cli import main; main()", *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    modules = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if "import time:" in line}
    return done, {name for name in HEAVY if name in modules}


@pytest.mark.parametrize("case", CASES)
def test_the_cli_answers_without_loading_the_work(case: str, tmp_path: Path) -> None:
    arguments, code, says = CASES[case]
    done, heavy = answer(arguments, tmp_path)
    output = done.stdout + "\n".join(ln for ln in done.stderr.splitlines() if "import time:" not in ln)
    assert done.returncode == code, output
    assert says in output
    assert not heavy, f"{case} imported {sorted(heavy)}"
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # an answer leaves nothing behind
