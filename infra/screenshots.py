"""Look at the product as a person would: run a job against a real Prefect server and a real MLflow
server, then take headless-Chromium screenshots of the Prefect flow-run page (and its Artifacts tab)
and of the MLflow run page.

    .venv/bin/python infra/screenshots.py --out docs/img                # runs `mlstm-sentiment demo`
    .venv/bin/python infra/screenshots.py --out /tmp/img --flow transfer --mlflow-stage transfer
    .venv/bin/python infra/screenshots.py --out /tmp/img --flow build_corpus --mlflow-stage corpus \\
        --command "mlstm-sentiment corpus build path/to/reviews/"

Both servers run on free loopback ports with their state in a temporary folder, the command runs in
another, and everything started here is stopped at the end (each process in its own process group,
so its children go too). A screenshot counts only once the page's DOM holds the run's data (its
name, its artifacts' keys, a metric's name) and the picture is not blank. Needs /usr/bin/chromium
(Debian: `apt-get install chromium`; or set CHROMIUM). Writes prefect-flow-run.png,
prefect-flow-run-artifacts.png and mlflow-run.png into --out, each with its page's DOM beside it (the
same name, .html); exits non-zero with a message on the first step that fails, keeping the servers'
and the command's logs.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from PIL import Image  # Pillow comes with mlflow (through matplotlib)

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
BIN = Path(sys.executable).parent  # the virtualenv's bin: prefect, mlflow, mlstm-sentiment
PREFECT_WINDOW = (1600, 1100)
# MLflow's run overview puts metrics and parameters below the tags: a taller window shows them too.
MLFLOW_WINDOW = (1600, 1800)


class Failed(RuntimeError):
    """A step failed; the message says which and why."""


@dataclass
class Servers:
    prefect: str  # http://127.0.0.1:P (the UI; the API is under /api)
    mlflow: str  # http://127.0.0.1:Q
    logs: Path

    @property
    def prefect_api(self) -> str:
        return f"{self.prefect}/api"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start a process in a new session, so that its whole process group can be stopped at once."""
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen[Any], timeout: float = 20) -> None:
    """SIGTERM the process group, SIGKILL it if the leader lingers, and always SIGKILL what is left
    of the group afterwards (uvicorn workers, torchrun ranks, browser helpers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise Failed(f"{url}: the server exited with {process.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise Failed(f"{url} did not answer within {timeout:.0f} s; see {log}")


@contextlib.contextmanager
def servers(state: Path) -> Iterator[Servers]:
    """A Prefect server (UI enabled) and an MLflow server on free loopback ports, state under state/."""
    logs = state / "logs"
    logs.mkdir(parents=True)
    p, q = free_port(), free_port()
    prefect_env = {
        **os.environ,
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "true",
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{p}/api",  # what the browser calls
        # Upgrade prompts and marketing banners are not the product: keep them out of the pictures.
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    }
    prefect_env.pop("PREFECT_API_URL", None)  # a user's setting must not point this server elsewhere
    # Without job execution, mlflow server does not spawn job runners too (gigabytes on a small machine).
    mlflow_env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    prefect_argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(p)]
    mlflow_argv = [
        str(BIN / "mlflow"), "server", "--workers", "1", "--host", "127.0.0.1", "--port", str(q),
        "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}",
        "--artifacts-destination", str(state / "mlflow-artifacts"),
    ]  # fmt: skip
    started: list[subprocess.Popen[bytes]] = []
    try:
        started.append(start(prefect_argv, prefect_env, logs / "prefect-server.log", state))
        started.append(start(mlflow_argv, mlflow_env, logs / "mlflow-server.log", state))
        wait_healthy(f"http://127.0.0.1:{p}/api/health", started[0], logs / "prefect-server.log")
        wait_healthy(f"http://127.0.0.1:{q}/health", started[1], logs / "mlflow-server.log")
        yield Servers(f"http://127.0.0.1:{p}", f"http://127.0.0.1:{q}", logs)
    finally:
        for process in reversed(started):
            stop(process)


def run_command(command: str, servers: Servers, cwd: Path, timeout: float) -> None:
    """Run the job the screenshots are about, against the two servers (the CLI reads these variables)."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PREFECT_API_URL": servers.prefect_api,
        "PREFECT_HOME": str(cwd / "prefect-client"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLSTM_MLFLOW_TRACKING_URI": servers.mlflow,
        "MLSTM_HOME": str(cwd / ".mlstm-sentiment"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    env.pop("MLSTM_PREFECT_API_URL", None)  # it would win over PREFECT_API_URL
    log = servers.logs / "command.log"
    print(f"running {command!r} in {cwd}", file=sys.stderr)
    started = time.monotonic()
    try:
        process = start(shlex.split(command), env, log, cwd)
    except OSError as error:  # no such program, not executable
        raise Failed(f"cannot run {command!r}: {error}") from None
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(f"{command!r} ran longer than {timeout:.0f} s; see {log}") from None
    finally:
        stop(process)
    if returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise Failed(f"{command!r} exited with {returncode}; the end of {log}:\n{tail}")
    print(f"  done in {time.monotonic() - started:.0f} s", file=sys.stderr)


def prefect_post(servers: Servers, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(f"{servers.prefect_api}/{path}", json=body, timeout=30)
    response.raise_for_status()
    return list(response.json())


def newest_flow_run(servers: Servers, flow: str) -> dict[str, Any]:
    """The newest run of the named flow; else, saying so, the newest top-level flow run of any flow."""
    found = prefect_post(
        servers,
        "flow_runs/filter",
        {"flows": {"name": {"any_": [flow]}}, "sort": "START_TIME_DESC", "limit": 1},
    )
    if found:
        return found[0]
    top_level = {
        "flow_runs": {"parent_task_run_id": {"is_null_": True}},
        "sort": "START_TIME_DESC",
        "limit": 1,
    }
    found = prefect_post(servers, "flow_runs/filter", top_level)
    if not found:
        raise Failed(f"the Prefect API at {servers.prefect_api} has no flow runs at all")
    name = httpx.get(f"{servers.prefect_api}/flows/{found[0]['flow_id']}", timeout=30).json()["name"]
    print(
        f"no run of flow {flow!r}: showing the newest top-level flow run instead, of {name!r}",
        file=sys.stderr,
    )
    return found[0]


def newest_mlflow_run(servers: Servers, stage: str) -> dict[str, Any]:
    """The newest MLflow run tagged stage=<stage>; else, saying so, the newest run of any stage."""
    api = f"{servers.mlflow}/api/2.0/mlflow"
    response = httpx.post(f"{api}/experiments/search", json={"max_results": 1000}, timeout=30)
    response.raise_for_status()
    experiments = [e["experiment_id"] for e in response.json().get("experiments", [])]

    def search(filter_string: str) -> list[dict[str, Any]]:
        body = {"experiment_ids": experiments, "filter": filter_string, "max_results": 1}
        body["order_by"] = ["attributes.start_time DESC"]
        response = httpx.post(f"{api}/runs/search", json=body, timeout=30)
        response.raise_for_status()
        return list(response.json().get("runs", []))

    found = search(f"tags.stage = '{stage}'")
    if found:
        return found[0]
    found = search("")
    if not found:
        raise Failed(f"the MLflow server at {servers.mlflow} has no runs at all")
    tags = {t["key"]: t["value"] for t in found[0]["data"].get("tags", [])}
    print(
        f"no MLflow run tagged stage={stage!r}: showing the newest run instead, "
        f"{found[0]['info']['run_name']!r} (stage={tags.get('stage')!r})",
        file=sys.stderr,
    )
    return found[0]


def looks_rendered(png: Path) -> bool:
    """A page has hundreds of colours (anti-aliased text); a blank page or a lone spinner a handful."""
    with Image.open(png) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    return colours is None or len(colours) > 256  # None: more than 65,536 colours


def screenshot(
    url: str,
    png: Path,
    expect: list[str],
    *,
    size: tuple[int, int] = PREFECT_WINDOW,
    budget_ms: int = 15000,
    attempts: int = 3,
) -> None:
    """Screenshot url with headless Chromium once its DOM holds every text of expect.

    --virtual-time-budget lets the page run that many ms of virtual time before the DOM is dumped and
    the picture taken: these single-page apps poll forever, so without a budget Chromium never decides
    the page has loaded. Virtual time stands still while requests are in flight and skips ahead while
    the page idles, so a large budget costs a few seconds, not the budget. The DOM holds the data after
    50 ms of it, but Prefect's flow-run graph (a canvas, which the DOM check cannot see) needs about
    1 s; 15 s leaves room for a slower machine. Each attempt doubles the budget.
    """
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
            argv = [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", "--run-all-compositor-stages-before-draw",
                f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                f"--virtual-time-budget={budget_ms}", "--dump-dom", f"--screenshot={png}", url,
            ]  # fmt: skip
            png.unlink(missing_ok=True)
            # Its own session, so that a hung browser and its helper processes are killed together.
            process = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
            try:
                dom, stderr = process.communicate(timeout=60 + 2 * budget_ms / 1000)
            except subprocess.TimeoutExpired:
                dom, stderr = b"", b"Chromium timed out"
            finally:
                stop(process, timeout=5)
        page = dom.decode(errors="replace")
        missing = [text for text in expect if html.escape(text, quote=False) not in page]
        if png.is_file() and looks_rendered(png) and not missing:
            # The page as the browser built it, beside its picture: what a test (or a person with grep)
            # checks the picture shows, since text in a PNG cannot be read back.
            png.with_suffix(".html").write_text(page)
            print(f"  {png.name}: {url} (attempt {attempt}, budget {budget_ms} ms)", file=sys.stderr)
            return
        why = f"the page lacks {missing}" if missing else "the picture is blank or missing"
        print(f"  {png.name}: {why}; trying again with a longer wait", file=sys.stderr)
        budget_ms *= 2
    raise Failed(
        f"no rendered screenshot of {url} after {attempts} attempts ({why}): {stderr.decode()[-1500:]}"
    )


def take_screenshots(servers: Servers, out: Path, flow: str, stage: str) -> list[Path]:
    """Screenshots of the newest run of flow in the Prefect UI and of stage's in the MLflow UI."""
    out.mkdir(parents=True, exist_ok=True)
    flow_run = newest_flow_run(servers, flow)
    artifacts = prefect_post(
        servers,
        "artifacts/filter",
        {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}, "type": {"not_any_": ["result"]}}},
    )
    keys = [a["key"] for a in artifacts if a.get("key")]
    if not artifacts:
        print(
            f"flow run {flow_run['name']!r} has no artifacts: its Artifacts tab will be empty",
            file=sys.stderr,
        )
    run = newest_mlflow_run(servers, stage)
    info, metrics = run["info"], run["data"].get("metrics", [])
    print(
        f"flow run {flow_run['name']!r} ({len(artifacts)} artifacts), MLflow run {info['run_name']!r}",
        file=sys.stderr,
    )
    # Prefect 3.8 serves two UIs; a browser opening the server's root is sent to V2 (React) at /v2.
    page = f"{servers.prefect}/v2/runs/flow-run/{flow_run['id']}"
    # A first visit to MLflow 3 shows its GenAI view; training runs belong in the "Model training" one.
    mlflow_page = f"{servers.mlflow}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}"
    shots = {
        "prefect-flow-run.png": (page, [flow_run["name"], flow_run["state"]["name"]], PREFECT_WINDOW),
        "prefect-flow-run-artifacts.png": (
            f"{page}?tab=Artifacts",
            [flow_run["name"], *keys[:3]],
            PREFECT_WINDOW,
        ),
        "mlflow-run.png": (
            f"{mlflow_page}?workflowType=machine_learning",
            [info["run_name"], *[m["key"] for m in metrics[:1]]],
            MLFLOW_WINDOW,
        ),
    }
    for name, (url, expect, size) in shots.items():
        screenshot(url, out / name, expect, size=size)
    return [out / name for name in shots]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    parser.add_argument(
        "--command", default="mlstm-sentiment demo", help="the job to run against the servers"
    )
    parser.add_argument("--flow", default="pipeline", help="Prefect flow whose newest run is shown")
    parser.add_argument("--mlflow-stage", default="pipeline", help="`stage` tag of the MLflow run shown")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the command may take")
    args = parser.parse_args(argv)
    if not os.access(CHROMIUM, os.X_OK):
        print(
            f"error: no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)", file=sys.stderr
        )
        return 2
    # A plain kill should stop the servers too: turn SIGTERM into an exception that unwinds through them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    tmp, keep = Path(tempfile.mkdtemp(prefix="mlstm-screenshots-")), False
    try:
        (tmp / "work").mkdir()
        with servers(tmp / "servers") as running:
            print(f"Prefect {running.prefect}, MLflow {running.mlflow}", file=sys.stderr)
            run_command(args.command, running, tmp / "work", args.timeout)
            shots = take_screenshots(running, args.out, args.flow, args.mlflow_stage)
    except (Failed, httpx.HTTPError) as error:
        keep = True  # the logs say what went wrong
        print(f"error: {error}\n(logs kept in {tmp / 'servers' / 'logs'})", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(map(str, shots)))
    print(f"done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
