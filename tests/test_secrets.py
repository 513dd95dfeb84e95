"""Credentials inside URLs reach the fetch that needs them and nothing the project writes or prints:
not the store, MLflow, Prefect, the logs or the terminal."""

from __future__ import annotations

import base64
import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mlflow_server_in

from tasks.corpus.sample import write_labelled_sample, write_sample
from tasks.secrets import hide, redact, redact_text, reveal

SOURCE_PASSWORD, SOURCE_TOKEN, MLFLOW_PASSWORD = "s0urce-Pa55", "t0ken-Va1ue", "mlfl0w-Pa55"


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("https://alice:pw@host:8080/a/b.json.gz", "https://***@host:8080/a/b.json.gz"),
        ("https://host/b.json.gz?token=abc&v=1", "https://host/b.json.gz?token=***&v=1"),
        (
            "https://b.s3.amazonaws.com/k.gz?X-Amz-Algorithm=A&X-Amz-Credential=AK%2F1&X-Amz-Signature=dead",
            "https://b.s3.amazonaws.com/k.gz?X-Amz-Algorithm=A&X-Amz-Credential=***&X-Amz-Signature=***",
        ),
        (
            "https://acct.blob.core.windows.net/c/f.gz?sv=2022&sig=abc%3D",
            "https://acct.blob.core.windows.net/c/f.gz?sv=2022&sig=***",
        ),
        ("postgresql://mlflow:pw@db:5432/mlflow", "postgresql://***@db:5432/mlflow"),
        ("s3://bucket/reviews/", "s3://bucket/reviews/"),
        ("/data/reviews?x=1.json", "/data/reviews?x=1.json"),
    ],
)
def test_redact_keeps_where_and_drops_the_secret(uri: str, shown: str) -> None:
    assert redact(uri) == shown
    assert redact(shown) == shown  # redacting twice is redacting once
    assert redact_text(f"cannot reach {uri}: refused") == f"cannot reach {shown}: refused"


def test_hide_gives_the_real_uri_back_to_the_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLSTM_SOURCE_SECRETS", raising=False)
    real = "https://alice:pw@host/a.json.gz?token=t"
    shown = hide(real)
    assert shown == redact(real) and reveal(shown) == real
    # A child process (a worker pool's) finds it too: the map travels in the environment.
    found = subprocess.run(
        [sys.executable, "-c", f"from tasks.secrets import reveal; print(reveal({shown!r}))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == real
    with pytest.raises(ValueError, match="differ only in their credentials"):
        hide("https://bob:other@host/a.json.gz?token=t")


class _BasicAuthHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder only to requests with the right password and token: proof the fetch got them."""

    def do_GET(self) -> None:
        expected = "Basic " + base64.b64encode(f"alice:{SOURCE_PASSWORD}".encode()).decode()
        if self.headers.get("Authorization") != expected or f"token={SOURCE_TOKEN}" not in self.path:
            self.send_error(401)
            return
        self.path = self.path.partition("?")[0]
        super().do_GET()

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def guarded_source(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    root = tmp_path / "served"
    files = write_sample(root, num_reviews=1200)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_BasicAuthHandler, directory=str(root))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://alice:{SOURCE_PASSWORD}@127.0.0.1:{server.server_address[1]}"
    try:
        yield base, [f"{base}/{f.name}?token={SOURCE_TOKEN}&v=2" for f in files]
    finally:
        server.shutdown()
        server.server_close()


def _hits(root: Path, secrets: tuple[str, ...]) -> list[str]:
    """Every file under ``root`` that holds one of ``secrets``, as bytes (SQLite databases included)."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_relative_to(root / "served"):
            data = path.read_bytes()
            found += [f"{path.relative_to(root)}: {s}" for s in secrets if s.encode() in data]
    return found


@pytest.mark.long  # the whole pipeline: about 100 s on two cores
def test_no_secret_of_a_source_or_tracking_uri_is_stored_or_printed(
    guarded_source: tuple[str, list[str]], tmp_path: Path
) -> None:
    """The whole pipeline, then `status` and `settings`, with a password and a token in every source URL
    and a password in the MLflow URI: the reviews are fetched (the server refuses requests without
    both), and no file under the home, the store, MLflow's server or Prefect's database, and no output,
    holds either."""
    _, sources = guarded_source
    labelled = write_labelled_sample(tmp_path / "labelled", num_reviews=400)
    with mlflow_server_in(tmp_path / "mlflow-server") as url:
        env = {**os.environ, "MLSTM_HOME": str(tmp_path / "home")}
        env["MLSTM_MLFLOW_TRACKING_URI"] = url.replace("://", f"://alice:{MLFLOW_PASSWORD}@")
        for name in ("PREFECT_API_URL", "PREFECT_HOME", "MLSTM_SOURCE_SECRETS"):
            env.pop(name, None)  # the temporary Prefect API, its database in the home
        fast = [
            "--set", "corpus.split=[90,5,5]", "--set", "pretrain.batch_size=16", "--set", "pretrain.seq_len=64",
            "--max-steps", "20", "--set", "pretrain.retries=0",
        ]  # fmt: skip
        cli = [sys.executable, "-c", "from flows.cli import main; main()"]
        said = []
        for args in (
            ["pipeline", *sources, "--dataset", f"reviews={labelled}", *fast],
            ["status"],
            ["settings"],
            ["corpus", "build", sources[0].replace("?", "-missing?")],  # a 404 quotes the URL
        ):
            done = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=900)
            said.append(done.stdout + done.stderr)
            assert done.returncode == (2 if args[0] == "corpus" else 0), said[-1]
    assert "registered" in said[0] and "***@127.0.0.1" in said[0] + said[1] + said[2]
    secrets = (SOURCE_PASSWORD, SOURCE_TOKEN, MLFLOW_PASSWORD)
    assert not [s for s in secrets if any(s in text for text in said)], said
    assert (tmp_path / "home" / "prefect").is_dir()  # Prefect's database is in the home, so it is searched
    assert not _hits(tmp_path, secrets)
