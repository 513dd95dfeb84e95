"""The team install of infra/compose.yaml for real, minus the containers: Postgres (initdb'd here, the
databases made by the same init.sql), the Prefect server on Postgres (asyncpg), the MLflow server with
its Postgres backend store (psycopg2) and S3 artifacts on the moto server, `mlstm-sentiment deploy` and
a process worker for the `cpu` pool; then a small pipeline through its deployment, read back from
Postgres and S3 as an operator would.

The services' commands, environments and healthchecks are read from compose.yaml, so the file and this
test cannot drift apart. Only what a container network provides is translated: the service names
(postgres:5432, minio:9000, prefect-server:4200, mlflow:5000) become free loopback ports, MinIO becomes
the moto server, `--host 0.0.0.0` becomes 127.0.0.1 and the program names the virtualenv's.

    MLSTM_SHARED_DIR=… .venv/bin/pytest tests/test_team_install.py -m long    # about 3 minutes on 2 cores
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import free_port
from test_infra_files import COMPOSE, command, compose, environment, interpolated, option

from tasks.corpus.sample import write_labelled_sample, write_sample

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PG_BIN = Path(os.environ.get("MLSTM_PG_BIN", "/usr/lib/postgresql/15/bin"))
PASSWORD = "team-install-test"
# The pipeline's settings for a few seconds of real work per stage (as tests/test_pipeline.py).
FAST = [
    "corpus.split=[90,5,5]", "pretrain.batch_size=16", "pretrain.seq_len=64", "pretrain.max_steps=40",
    "pretrain.checkpoint_every=40", "pretrain.val_every=40", "pretrain.retries=0", "pretrain.lr=0.003",
]  # fmt: skip


@dataclass
class Team:
    """The running install: loopback addresses for the compose service names, and what was started."""

    root: Path
    ports: dict[str, int]
    s3: str  # the moto endpoint standing in for MinIO
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def addresses(self) -> dict[str, str]:
        moto = urlsplit(self.s3).netloc
        return {
            "postgres:5432": f"127.0.0.1:{self.ports['postgres']}",
            "minio:9000": moto,
            "prefect-server:4200": f"127.0.0.1:{self.ports['prefect']}",
            "mlflow:5000": f"127.0.0.1:{self.ports['mlflow']}",
            "127.0.0.1:4200": f"127.0.0.1:{self.ports['prefect']}",  # the healthchecks
            "127.0.0.1:5000": f"127.0.0.1:{self.ports['mlflow']}",
            "127.0.0.1:8080": f"127.0.0.1:{self.ports['worker']}",
        }

    def variables(self) -> dict[str, str]:
        """infra/.env for this install (the S3 user is moto's, which accepts any key)."""
        return {
            "POSTGRES_PASSWORD": PASSWORD,
            "S3_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
            "S3_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            "MINIO_ROOT_USER": "unused",
            "MINIO_ROOT_PASSWORD": "unused",
            "PREFECT_UI_API_URL": f"http://127.0.0.1:{self.ports['prefect']}/api",
            "MLFLOW_ALLOWED_HOSTS": f"127.0.0.1,127.0.0.1:{self.ports['mlflow']},localhost",
        }

    def local(self, text: str) -> str:
        for service, address in self.addresses.items():
            text = text.replace(service, address)
        return text

    def service(self, name: str) -> tuple[list[str], dict[str, str]]:
        """A compose service's command and environment, on loopback, with this machine's programs."""
        spec = interpolated(compose()["services"][name], self.variables())
        argv = [self.local(arg) for arg in command(spec)]
        argv[0] = program(argv[0])
        env = {key: self.local(str(value)) for key, value in environment(spec).items()}
        return argv, env

    def healthcheck(self, name: str) -> list[str]:
        test = interpolated(compose()["services"][name]["healthcheck"]["test"], self.variables())
        assert test[0] == "CMD", f"{name}: a healthcheck in exec form"
        return [program(test[1]), *(self.local(arg) for arg in test[2:])]

    def base_env(self, name: str) -> dict[str, str]:
        """What a container has without asking: a PATH, a home of its own, no settings of the host's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLSTM_", "PREFECT_", "MLFLOW_"))}
        home = self.root / name
        home.mkdir(exist_ok=True)
        env.pop("AWS_ENDPOINT_URL", None)  # only the endpoint the service's own environment names
        return {
            **env,
            "PATH": f"{BIN}{os.pathsep}{env['PATH']}",
            "PREFECT_HOME": str(home / "prefect"),
            "MLSTM_HOME": str(home / "mlstm"),
            "MLFLOW_DISABLE_TELEMETRY": "true",
        }

    def start(self, name: str, argv: list[str], env: dict[str, str], **kwargs: Any) -> None:
        """Start a service in its own session (so that its whole process group stops together)."""
        with (self.root / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                argv, env=env, cwd=kwargs.pop("cwd", ROOT), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, **kwargs,
            )  # fmt: skip
        self.started.append(process)
        self.wait_healthy(name, process)

    def wait_healthy(self, name: str, process: subprocess.Popen[bytes], timeout: float = 180) -> None:
        probe, env = self.healthcheck(name), {**os.environ, "PGPORT": str(self.ports["postgres"])}
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, f"{name} exited {process.returncode}: {self.log(name)}"
            if subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 0:
                return
            assert time.monotonic() < deadline, f"{name} not healthy after {timeout:.0f} s: {self.log(name)}"
            time.sleep(1)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def stop(self) -> list[str]:
        """Stop everything, newest first: SIGTERM to each process group (SIGINT to Postgres), SIGKILL
        after a grace. Returns the groups that still have members after that (there should be none)."""
        left = []
        for process in reversed(self.started):
            # Postgres: SIGINT is its fast shutdown (SIGTERM would wait for every client to leave).
            first = signal.SIGINT if Path(process.args[0]).name == "postgres" else signal.SIGTERM  # type: ignore[index]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, first)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.killpg(process.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                left.append(" ".join(map(str, process.args)))  # type: ignore[arg-type]
        self.started.clear()
        return left


def program(name: str) -> str:
    """The compose images' programs from this machine: the virtualenv's, then Postgres's."""
    if name == "python":
        return sys.executable
    for folder in (BIN, PG_BIN):
        if (folder / name).is_file():
            return str(folder / name)
    return shutil.which(name) or name


def postgres_user() -> dict[str, Any]:
    """Postgres refuses to run as root (CI runs as root): there, run it as nobody."""
    if os.getuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


def start_postgres(team: Team) -> None:
    """initdb as compose's postgres image does (POSTGRES_USER, POSTGRES_PASSWORD), start the server on
    loopback, then run the init script compose mounts into /docker-entrypoint-initdb.d."""
    spec = interpolated(compose()["services"]["postgres"], team.variables())
    user, password = spec["environment"]["POSTGRES_USER"], spec["environment"]["POSTGRES_PASSWORD"]
    as_postgres = postgres_user()
    pg = team.root / "postgres"
    pg.mkdir()
    (pg / "password").write_text(password)
    if as_postgres:
        for path in (pg, pg / "password"):
            os.chown(path, as_postgres["user"], as_postgres["group"])
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    initdb = [str(PG_BIN / "initdb"), "-D", str(pg / "data"), "-U", user, f"--pwfile={pg / 'password'}"]
    initdb += ["--auth=scram-sha-256", "--encoding=UTF8"]
    done = subprocess.run(initdb, env=env, cwd=pg, capture_output=True, text=True, timeout=120, **as_postgres)
    assert done.returncode == 0, done.stdout + done.stderr
    port = str(team.ports["postgres"])
    server = [str(PG_BIN / "postgres"), "-D", str(pg / "data"), "-h", "127.0.0.1", "-p", port, "-k", str(pg)]
    team.start("postgres", server, env, cwd=pg, **as_postgres)
    (script,) = [v.split(":")[0] for v in spec["volumes"] if "docker-entrypoint-initdb.d" in v]
    psql = [str(PG_BIN / "psql"), "-h", "127.0.0.1", "-p", port, "-U", user, "-d", "postgres"]
    psql += ["-v", "ON_ERROR_STOP=1", "-f", str(COMPOSE.parent / script)]
    done = subprocess.run(psql, env={**env, "PGPASSWORD": password}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def listen_on_loopback(argv: list[str], port: int) -> list[str]:
    """`--host 0.0.0.0` (every interface of a container) → 127.0.0.1, and this install's port."""
    argv = list(argv)
    for name, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if name in argv:
            argv[argv.index(name) + 1] = value
        else:
            argv += [name, value]
    return argv


@contextlib.contextmanager
def team_install(s3_server: str) -> Iterator[Team]:
    # A short path of its own under /tmp: the Postgres socket lives there, and nobody must reach it.
    root = Path(tempfile.mkdtemp(prefix="mlstm-team-", dir="/tmp"))
    os.chmod(root, 0o755)
    ports = {name: free_port() for name in ("postgres", "prefect", "mlflow", "worker")}
    team = Team(root, ports, s3_server)
    failed = True
    try:
        start_postgres(team)
        # minio-init's buckets (`mc mb local/mlstm local/mlflow`), on the moto server.
        import boto3

        s3 = boto3.client("s3", endpoint_url=s3_server)
        for bucket in re.findall(
            r"local/([a-z0-9.-]+)", " ".join(command(compose()["services"]["minio-init"]))
        ):
            with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
                s3.create_bucket(Bucket=bucket)

        argv, env = team.service("prefect-server")
        team.start(
            "prefect-server",
            listen_on_loopback(argv, ports["prefect"]),
            {**team.base_env("prefect-server"), **env},
        )
        argv, env = team.service("mlflow")
        team.start("mlflow", listen_on_loopback(argv, ports["mlflow"]), {**team.base_env("mlflow"), **env})

        argv, env = team.service("deploy")
        done = subprocess.run(
            argv,
            env={**team.base_env("deploy"), **env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "created work pool cpu" in done.stdout, done.stdout

        argv, env = team.service("worker")
        # The worker's healthcheck server listens on 8080 in its container; here on a free port.
        web = {
            "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1",
            "PREFECT_WORKER_WEBSERVER_PORT": str(ports["worker"]),
        }
        team.start("worker", argv, {**team.base_env("worker"), **env, **web})
        yield team
        failed = False
    finally:
        lingering = team.stop()
        if failed:  # the services' logs say why
            print(f"logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
        assert not lingering, f"still running after SIGKILL: {lingering}"


def query(team: Team, database: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg2

    connection = psycopg2.connect(
        host="127.0.0.1", port=team.ports["postgres"], user="mlstm", password=PASSWORD, dbname=database
    )
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, args)
            return list(cursor.fetchall())
    finally:
        connection.close()


@pytest.mark.long
@pytest.mark.timeout(1800)  # five servers and three stages on two busy cores
def test_a_pipeline_through_the_team_install_lands_in_postgres_and_s3(s3_server: str, tmp_path: Path) -> None:
    pytest.importorskip("psycopg2", reason="the team extra: pip install -c constraints.txt '.[team]'")
    pytest.importorskip("asyncpg", reason="the team extra: pip install -c constraints.txt '.[team]'")
    if not (PG_BIN / "initdb").is_file():
        pytest.skip(
            f"needs PostgreSQL's initdb in {PG_BIN} (apt-get install postgresql, or set MLSTM_PG_BIN)"
        )
    sample = write_sample(tmp_path / "sample", num_reviews=1200)[0].parent
    labelled = write_labelled_sample(tmp_path / "labelled", num_reviews=600)
    with team_install(s3_server) as team:
        # A user's shell, set up as docs/operations.md says: the worker's environment (x-client-env).
        _, client_env = team.service("worker")
        env = {**team.base_env("client"), **client_env}
        sets = [f'sources=["{sample}"]', f'transfer.datasets=["reviews={labelled}"]', *FAST]
        args = [str(BIN / "mlstm-sentiment"), "run", "corpus", "--rest", "--json"]
        args += ["--deployment", "pipeline/transfer-nightly", *(f"--set={s}" for s in sets)]
        try:
            done = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
        except subprocess.TimeoutExpired as timeout:
            raise AssertionError(f"{timeout.stderr!r}\n{team.log('worker')}") from None
        assert done.returncode == 0, done.stderr[-3000:] + team.log("worker")
        result = json.loads(done.stdout)
        assert {s: i["state"] for s, i in result["stages"].items()} == dict.fromkeys(
            ("corpus", "pretrain", "transfer"), "ran"
        )
        flow_run_id = re.search(r"flow run ([0-9a-f-]{36}) of pipeline/transfer-nightly", done.stderr)
        assert flow_run_id, done.stderr

        # Prefect's database: the deployment's run and its stage subflows, completed.
        runs = query(
            team, "prefect",
            "SELECT f.name, r.state_type FROM flow_run r JOIN flow f ON f.id = r.flow_id "
            "WHERE r.id = %s OR r.parent_task_run_id IN "
            "(SELECT id FROM task_run WHERE flow_run_id = %s)",
            flow_run_id[1], flow_run_id[1],
        )  # fmt: skip
        assert set(runs) >= {
            ("pipeline", "COMPLETED"),
            ("build_corpus", "COMPLETED"),
            ("pretrain", "COMPLETED"),
        }, runs
        deployment = query(
            team, "prefect",
            "SELECT d.name FROM flow_run r JOIN deployment d ON d.id = r.deployment_id "
            "WHERE r.id = %s", flow_run_id[1],
        )  # fmt: skip
        assert deployment == [("transfer-nightly",)], deployment

        # MLflow's database: the parent run and a child per stage, finished, with their metrics.
        parent = result["run_id"]
        status = query(team, "mlflow", "SELECT status FROM runs WHERE run_uuid = %s", parent)
        assert status == [("FINISHED",)]
        children = query(
            team, "mlflow",
            "SELECT t.value, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'stage' "
            "WHERE r.run_uuid IN (SELECT run_uuid FROM tags WHERE key = 'mlflow.parentRunId' AND value = %s)",
            parent,
        )  # fmt: skip
        assert sorted(children) == [(s, "FINISHED") for s in ("corpus", "pretrain", "transfer")], children
        metrics = dict(
            query(team, "mlflow", "SELECT key, value FROM latest_metrics WHERE run_uuid = %s", parent)
        )
        assert metrics["reviews_test_accuracy"] > 0.5, metrics
        transfer_run = result["stages"]["transfer"]["run_id"]
        transfer_metrics = query(
            team, "mlflow", "SELECT key FROM latest_metrics WHERE run_uuid = %s", transfer_run
        )
        assert ("reviews_test_accuracy",) in transfer_metrics, transfer_metrics

        # The registered version, in the registry's tables, made by the transfer run, and @champion.
        versions = query(team, "mlflow", "SELECT name, version, run_id, storage_location FROM model_versions")
        assert [v[:3] for v in versions] == [("mlstm-sentiment", 1, transfer_run)], versions
        aliases = query(team, "mlflow", "SELECT name, alias, version FROM registered_model_aliases")
        assert aliases == [("mlstm-sentiment", "champion", 1)], aliases

        # The model's files in the artifacts bucket, where the version's storage location says.
        import boto3

        s3 = boto3.client("s3", endpoint_url=team.s3)
        # The server proxies artifacts (mlflow-artifacts:/PATH) to PATH under --artifacts-destination.
        location = urlsplit(versions[0][3])
        destination = option(command(compose()["services"]["mlflow"]), "--artifacts-destination")
        bucket = urlsplit(destination or "")
        assert location.scheme == "mlflow-artifacts" and bucket.scheme == "s3", (versions[0][3], destination)
        prefix = f"{bucket.path.strip('/')}/{location.path.lstrip('/')}".lstrip("/")
        listed = s3.list_objects_v2(Bucket=bucket.netloc, Prefix=prefix)
        names = {Path(item["Key"]).name for item in listed.get("Contents", [])}
        assert {"MLmodel", "classifier.npz"} <= names, (prefix, names)

        # The store (MLSTM_STORE_URI): the corpus manifest and the checkpoint.
        store = urlsplit(client_env["MLSTM_STORE_URI"])
        keys = [
            item["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.netloc)
            for item in page.get("Contents", [])
        ]
        root = store.path.strip("/")
        assert any(re.fullmatch(rf"{root}/corpora/\w+/manifest\.json", k) for k in keys), keys[:20]
        assert any(re.fullmatch(rf"{root}/runs/[^/]+/latest\.json", k) for k in keys), keys[:20]
