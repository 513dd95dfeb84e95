"""A registered classifier read as data: the project's readers (``predict``, ``score``, ``explain``,
``generate``, the transfer stage's champion) resolve a model URI, download the artifact's files once,
and build the classifier from the installed package (``models.mlflow_loader.load_served``). They never
go through ``mlflow.pyfunc.load_model``, which follows whatever the artifact's ``MLmodel`` names: a
loader module shipped in its ``code/`` folder, or a pickled python model.

The classifier's files are signed when logged (``SIGNATURE_FILE``: their sha256 under the key's HMAC,
as a checkpoint's ``meta.json``; the key of ``tasks/signing.py``) and refused here when changed,
unsigned, or signed with another key.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks import signing
from tasks.settings import Settings

if TYPE_CHECKING:
    from models.serving import SentimentModel

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))$")
SIGNATURE_FILE = "signature.json"  # beside classifier.json: each file's sha256, signed
SIGNED_FILES = ("classifier.json", "classifier.npz")


class ModelNotFound(ValueError):
    """A model URI that names nothing this project can read."""


class UntrustedModel(signing.Untrusted):
    """A classifier whose files do not carry the key's signature, or changed since they were signed."""


@dataclass(frozen=True)
class RegisteredModel:
    """A classifier's files on this machine, and the registered version they came from (if any)."""

    uri: str
    folder: Path  # the folder holding classifier.json and classifier.npz
    name: str | None = None
    version: int | None = None
    run_id: str | None = None


def sign_folder(folder: Path) -> None:
    """Write ``SIGNATURE_FILE`` for a classifier's saved folder (before it is logged)."""
    body = signing.signed({"sha256": {name: _sha256(folder / name) for name in SIGNED_FILES}})
    (folder / SIGNATURE_FILE).write_text(json.dumps(body, indent=2))


def check_folder(folder: Path, uri: str) -> None:
    """Refuse (``UntrustedModel``, naming ``uri``) a classifier whose files are not the ones signed under
    the key."""
    secret = signing.key()
    where = f"{uri} ({folder / SIGNATURE_FILE})"
    try:
        body: dict[str, Any] = json.loads((folder / SIGNATURE_FILE).read_text())
    except (OSError, ValueError):
        raise UntrustedModel(
            f"{where} is missing or unreadable: not read (logged before signing was on by default, or not "
            "by the pipeline: register it again from its checkpoint with `mlstm-sentiment transfer`)"
        ) from None
    signing.check(secret, body, where, UntrustedModel)
    for name in SIGNED_FILES:
        if body.get("sha256", {}).get(name) != _sha256(folder / name):
            raise UntrustedModel(f"{uri}: {name} changed since it was signed: not read")


def resolve(uri: str | None, settings: Settings) -> RegisteredModel:
    """The classifier ``uri`` names (default: the champion), its files downloaded: a registered version
    once into ``<home>/cache/models/NAME-vN-HASH`` (HASH: the registry and the version's source), any other MLflow URI or folder afresh into
    ``<home>/cache/models/uri-HASH``. Raises ``ModelNotFound`` in one line."""
    from mlflow.exceptions import MlflowException

    from tasks.tracking import connect

    uri = uri or f"models:/{settings.model_name}@champion"
    connect(settings)
    match = MODEL_URI.match(uri)
    try:
        if match is None:  # a logged model (models:/m-…), a run's artifact, a folder
            # One folder a URI, fetched afresh each time (a folder or a run's files may have changed):
            # a scratch folder a call would leave one copy of the model behind per `predict`.
            root = _cache(settings) / f"uri-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"
            shutil.rmtree(root, ignore_errors=True)
            return RegisteredModel(uri=uri, folder=data_folder(_download(uri, root), uri))
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        name = match["name"]
        version = (
            client.get_model_version(name, match["version"])
            if match["version"]
            else client.get_model_version_by_alias(name, match["alias"])
        )
        # Named by the version and what it is (registry, source, creation): a new registry or a model
        # deleted and registered again reuses NAME and N for other files, never served from this cache.
        identity = "\n".join(
            map(str, (settings.shown_mlflow_tracking_uri, name, version.version, version.source,
                      version.run_id, version.creation_timestamp))
        )  # fmt: skip
        digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
        root = _cache(settings) / f"{re.sub(r'[^A-Za-z0-9_.-]', '-', name)}-v{version.version}-{digest}"
        if not (root / "MLmodel").exists():
            _download(f"models:/{name}/{version.version}", root)
        return RegisteredModel(
            uri=uri,
            folder=data_folder(root, uri),
            name=name,
            version=int(version.version),
            run_id=version.run_id,
        )
    except MlflowException as error:
        raise ModelNotFound(
            f"cannot load {uri} from {settings.shown_mlflow_tracking_uri}: {error.message}"
        ) from None


def load(model: RegisteredModel) -> SentimentModel:
    """The classifier of ``model``'s files, checked against their signature, built by this package."""
    from models.mlflow_loader import load_served

    check_folder(model.folder, model.uri)
    return load_served(model.folder)


def _cache(settings: Settings) -> Path:
    folder = settings.home / "cache" / "models"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _download(uri: str, root: Path) -> Path:
    import mlflow.artifacts

    root.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(root)))


def data_folder(root: Path, uri: str) -> Path:
    """The folder of the classifier's files in a downloaded model: ``MLmodel``'s pyfunc ``data`` (read as
    YAML data, never acted on), which must stay inside the model and hold ``classifier.json``."""
    import yaml

    try:
        mlmodel = yaml.safe_load((root / "MLmodel").read_text())
        data = str(mlmodel["flavors"]["python_function"]["data"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        raise ModelNotFound(
            f"{uri} is not a classifier this project logged: its MLmodel names no data folder"
        ) from None
    folder = (root / data).resolve()
    if not folder.is_relative_to(root.resolve()) or not (folder / SIGNED_FILES[0]).is_file():
        raise ModelNotFound(
            f"{uri} is not a classifier this project logged: no {SIGNED_FILES[0]} in its data folder"
        )
    return folder


def _sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""
