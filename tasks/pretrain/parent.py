"""The parent of a continued run: which checkpoint ``--init-from`` names, and what the run records of it.

``--init-from`` takes a checkpoint URI (a step folder, a run folder or its ``latest.json``), the name of a
run in the store (its latest checkpoint), or ``champion``: the checkpoint behind the registered champion
(its version's ``checkpoint_uri`` tag, which a probe's and a fine-tuned classifier's versions both carry).
Whatever the name, the parent is one step folder, known by the digest of its files: that digest, not the
name, is the parent's part of the run's identity (``tasks.pretrain.config.run_key``), so ``champion``
moving to other weights makes another run, and a run's name and its URI make the same one.

Only ``meta.json`` is read here (the job loads the weights): planning a launch stays cheap.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from tasks.settings import Settings
from tasks.store import StoreError, store_of

CHAMPION = "champion"


class Parent(BaseModel):
    """The checkpoint a continued run starts from, as its ``meta.json`` describes it."""

    model_config = ConfigDict(frozen=True)

    checkpoint_uri: str  # the step folder
    digest: str  # sha256 of its files' digests (tasks.jobs.checkpoint.checkpoint_digest)
    run: str
    step: int
    preset: str
    corpus: str  # the manifest URI of the corpus it was trained on: the replay's source
    mlflow_run_id: str | None = None

    def tags(self) -> dict[str, str]:
        """The continued run's lineage in MLflow: ``parent`` is the checkpoint it started from (as
        Determined's warm start shows its source), the rest what that checkpoint is."""
        tags = {
            "parent": self.checkpoint_uri,
            "parent_digest": self.digest,
            "parent_run": self.run,
            "parent_step": str(self.step),
            "parent_corpus": self.corpus,
        }
        if self.mlflow_run_id:
            tags["parent_mlflow_run_id"] = self.mlflow_run_id
        return tags


def read_parent(checkpoint_uri: str, **store_options: Any) -> Parent:
    """The parent a checkpoint URI names, from its ``meta.json`` alone."""
    from tasks.jobs.checkpoint import checkpoint_digest, read_meta

    uri, meta = read_meta(checkpoint_uri, **store_options)
    return Parent(
        checkpoint_uri=uri,
        digest=checkpoint_digest(meta),
        run=meta["run"],
        step=int(meta["step"]),
        preset=meta["preset"],
        corpus=meta["corpus"],
        mlflow_run_id=meta.get("mlflow_run_id"),
    )


def find_parent(init_from: str, settings: Settings) -> Parent:
    """The checkpoint ``--init-from`` names (see the module's docstring), or one line saying why none."""
    from tasks.jobs.checkpoint import DamagedCheckpoint

    options: dict[str, Any] = {
        "endpoint_url": settings.s3_endpoint_url,
        "max_attempts": settings.s3_max_attempts,
    }
    if init_from == CHAMPION:
        uri = champion_checkpoint(settings)
    elif "://" in init_from or "/" in init_from:
        uri = init_from
    else:  # a run's name
        store = store_of(settings)
        if not store.exists(f"runs/{init_from}/latest.json"):
            raise ValueError(
                f"--init-from {init_from}: no run of that name in {settings.resolved_store_uri} (give a "
                "checkpoint URI, a run's name, or champion)"
            )
        uri = store.url(f"runs/{init_from}")
    try:
        return read_parent(uri, **options)
    except (StoreError, OSError, DamagedCheckpoint) as error:
        raise ValueError(f"--init-from {init_from}: {error}") from None


def champion_checkpoint(settings: Settings) -> str:
    """The checkpoint the registered champion's features come from (its version's ``checkpoint_uri``)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tasks.tracking import connect

    connect(settings)
    name = settings.model_name
    try:
        version = MlflowClient().get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        raise ValueError(
            f"--init-from champion: {name} has no @champion at {settings.shown_mlflow_tracking_uri}: "
            "give a checkpoint URI or a run's name"
        ) from None
    uri = version.tags.get("checkpoint_uri")
    if not uri:
        raise ValueError(f"--init-from champion: {name} v{version.version} has no checkpoint_uri tag")
    return str(uri)
