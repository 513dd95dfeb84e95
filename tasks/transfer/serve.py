"""A registered model served as users serve it: ``mlflow models serve``, then POST /invocations."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tasks.processes import stop_group

BIN = Path(sys.executable).parent


class ServeError(RuntimeError):
    """The scoring server did not come up."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(
    model_uri: str, tracking_uri: str, *, registry_uri: str | None = None, port: int = 5001
) -> str:
    """``mlflow models serve`` as a shell command to print for users: it works as printed, from any
    folder, with this environment not activated (MLflow starts ``uvicorn`` by name, so this
    environment's bin goes first on PATH; without it the server dies with return code 127)."""
    env = [
        f'PATH={shlex.quote(str(BIN))}{os.pathsep}"$PATH"',
        f"MLFLOW_TRACKING_URI={shlex.quote(tracking_uri)}",
        # Else MLflow writes a telemetry id into the user's ~/.config/mlflow.
        "MLFLOW_DISABLE_TELEMETRY=true",
    ]
    if registry_uri and registry_uri != tracking_uri:
        env.append(f"MLFLOW_REGISTRY_URI={shlex.quote(registry_uri)}")
    command = [
        str(BIN / "mlflow"),
        "models",
        "serve",
        "-m",
        model_uri,
        "--env-manager",
        "local",
        "-p",
        str(port),
    ]
    return " ".join([*env, shlex.join(command)])


@contextlib.contextmanager
def served(model_uri: str, tracking_uri: str, *, log: Path, timeout: float = 180) -> Iterator[str]:
    """Run ``mlflow models serve`` on a free loopback port for the block; yields its base URL.

    The server's output goes to ``log`` (its last lines are in the error if it does not come up); the
    whole process group is stopped at the end.
    """
    port = _free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking_uri,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # It starts uvicorn by name: this environment's bin must come first on PATH.
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    command = [str(BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as output:
        server = subprocess.Popen(
            command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise ServeError(f"`{shlex.join(command)}` exited ({server.returncode}):\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise ServeError(
                    f"`{shlex.join(command)}` did not answer /ping in {timeout:g} s:\n{_tail(log)}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        stop_group(server, grace=30)


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def invoke(url: str, texts: list[str]) -> list[dict[str, Any]]:
    """POST texts to a scoring server's /invocations; returns its predictions, one per text."""
    body = {"dataframe_records": [{"text": text} for text in texts]}
    response = httpx.post(f"{url}/invocations", json=body, timeout=120)
    if response.status_code != 200:
        raise ServeError(f"POST {url}/invocations answered {response.status_code}: {response.text[:500]}")
    return response.json()["predictions"]
