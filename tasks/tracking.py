"""MLflow: where each stage records what it did."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from tasks.secrets import redact, redact_text
from tasks.settings import Settings

log = logging.getLogger(__name__)

# Seconds a tracking server or database has to accept a connection before the command gives up (MLflow
# itself retries an unreachable database for about 100 s).
CONNECT_TIMEOUT = 5.0
# Ports of the databases MLflow stores runs in, for a URI that names none.
_DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server does not answer."""


def connect(settings: Settings) -> Any:
    """Point MLflow at the configured server and experiment (creating the local database if needed)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    uri, source = settings.mlflow_tracking_uri_source
    setting = "MLSTM_MLFLOW_TRACKING_URI" if source == "default" else source
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri.removeprefix("sqlite:///")) or ".", exist_ok=True)
    check_server(uri, setting)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(settings.resolved_mlflow_registry_uri)
    try:
        root = artifact_root(settings, uri)
        if root and mlflow.get_experiment_by_name(settings.mlflow_experiment) is None:
            _create_experiment(settings.mlflow_experiment, root)
        return mlflow.set_experiment(settings.mlflow_experiment)
    except Exception as error:
        reason = redact_text(
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        )
        raise TrackingUnavailable(
            f"MLflow at {redact(uri)} cannot be used ({reason}); fix {setting}"
        ) from error


def artifact_root(settings: Settings, tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: with an embedded SQLite store, a folder under
    MLSTM_HOME (MLflow's own default is ``./mlruns`` of whatever folder the command ran in); with a
    tracking server, None: the server's ``--default-artifact-root`` (S3 in the team install) decides."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    return (settings.home.resolve() / "mlartifacts").as_uri()


def _create_experiment(name: str, artifact_location: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient().create_experiment(name, artifact_location=artifact_location)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":  # another process made it first: fine
            raise


def check_server(uri: str, setting: str = "MLSTM_MLFLOW_TRACKING_URI") -> None:
    """A tracking server or database that does not answer is one quick, clear error, not minutes of
    MLflow's retries."""
    scheme = uri.partition(":")[0].partition("+")[0].lower()
    if scheme in _DATABASE_PORTS:
        _check_database(uri, scheme, setting)
    if not uri.startswith(("http://", "https://")):
        return
    import httpx

    try:
        httpx.get(f"{uri.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as error:
        raise TrackingUnavailable(
            f"the MLflow tracking server at {redact(uri)} does not answer ({redact_text(str(error))}); "
            f"start it, or fix {setting}"
        ) from error


def _check_database(uri: str, scheme: str, setting: str) -> None:
    """A database URI's host accepts a TCP connection within ``CONNECT_TIMEOUT``."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if not parts.hostname:  # a Unix socket (the drivers' default without a host): not TCP to check
        return
    try:
        host, port = parts.hostname, parts.port or _DATABASE_PORTS[scheme]
    except ValueError as error:  # a port that is not a number
        raise TrackingUnavailable(f"{redact(uri)} is not a database URI ({error}); fix {setting}") from None
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else (error.strerror or str(error))
        raise TrackingUnavailable(
            f"the MLflow tracking database at {redact(uri)} does not answer ({reason}; "
            f"{CONNECT_TIMEOUT:g} s allowed to connect); start it, or fix {setting}"
        ) from None


def nothing_tracked(settings: Settings) -> bool:
    """Whether MLflow is the embedded SQLite file and it does not exist yet: nothing has run, which a
    reader (``status``) can say without importing MLflow or creating the database."""
    uri = settings.resolved_mlflow_tracking_uri
    return uri.startswith("sqlite:///") and not os.path.exists(uri.removeprefix("sqlite:///"))


def experiment_id(settings: Settings) -> str:
    return str(connect(settings).experiment_id)


def find_run(settings: Settings, tags: dict[str, str]) -> Any | None:
    """The newest finished run of the experiment with all of ``tags``, or None."""
    from mlflow.tracking import MlflowClient

    query = " and ".join(
        [f"tags.`{k}` = '{v}'" for k, v in tags.items()] + ["attributes.status = 'FINISHED'"]
    )
    experiment = experiment_id(settings)  # connects first: a client made before would use the default URI
    runs = MlflowClient().search_runs(
        [experiment], query, max_results=1, order_by=["attributes.start_time DESC"]
    )
    return runs[0] if runs else None


def ui_base(settings: Settings) -> str | None:
    """Where the MLflow UI is: the tracking server itself, or None for a local database."""
    uri = settings.shown_mlflow_tracking_uri
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else None


def run_link(settings: Settings, experiment_id: str, run_id: str) -> str:
    """A markdown link to a run in the MLflow UI, or how to open it when MLflow is a local file."""
    base = ui_base(settings)
    if base is None:
        return f"`{run_id}` (`mlflow ui --backend-store-uri {settings.shown_mlflow_tracking_uri}`)"
    return f"[{run_id}]({base}/#/experiments/{experiment_id}/runs/{run_id})"


def artifact_link(settings: Settings, experiment_id: str, run_id: str, path: str) -> str:
    """A markdown link to one artifact of a run in the MLflow UI, or its path when MLflow is a local file."""
    base = ui_base(settings)
    if base is None:
        return f"`{path}` of run `{run_id}`"
    return f"[{path}]({base}/#/experiments/{experiment_id}/runs/{run_id}/artifactPath/{path})"


def model_link(settings: Settings, name: str, version: int | str) -> str:
    base = ui_base(settings)
    if base is None:
        return f"`models:/{name}/{version}`"
    return f"[{name} v{version}]({base}/#/models/{name}/versions/{version})"


@contextlib.contextmanager
def mlflow_run(settings: Settings, *, run_name: str, tags: dict[str, str]) -> Iterator[Any]:
    """Start an MLflow run in the configured experiment."""
    import mlflow

    connect(settings)
    with mlflow.start_run(run_name=run_name, tags=tags) as run:
        yield run


def run_exists(run_id: str) -> bool:
    """Whether the connected tracking server has this run (a reset or changed server does not)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient().get_run(run_id)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


def start_tracking(settings: Settings, *, run_id: str | None, run_name: str, tags: dict[str, str]) -> Any:
    """Make an MLflow run active: ``run_id``'s (a flow's run, or a resumed one's), else a new one.
    A ``run_id`` this server does not have starts a new run tagged with it."""
    import mlflow

    connect(settings)
    if run_id and not run_exists(run_id):
        log.warning(
            "MLflow run %s is not at %s: logging into a new run tagged resumed_from_run_id",
            run_id,
            settings.shown_mlflow_tracking_uri,
        )
        tags = {**tags, "resumed_from_run_id": run_id}
        run_id = None
    if run_id:
        run = mlflow.start_run(run_id=run_id)
        mlflow.set_tags(tags)
        return run
    return mlflow.start_run(run_name=run_name, tags=tags)
