"""What a job's ranks are told about where they are: the same store and MLflow as the process that
launched them, wherever they start (this machine, a Slurm node, a pod)."""

from __future__ import annotations

import os
from pathlib import Path

from tasks import signing
from tasks.jobs.config import LauncherName
from tasks.settings import Settings


def absolute_uri(uri: str) -> str:
    """Ranks may start in another folder (a Slurm node, a pod): relative paths become absolute."""
    return uri if "://" in uri else str(Path(uri).resolve())


def job_environment(settings: Settings, launcher: LauncherName = "local") -> dict[str, str]:
    """What the ranks need to find the same store and MLflow as this process (and, on this machine
    or a Slurm cluster's shared disk, the same caches and checkpoint key; a pod keeps its own caches).

    The ranks sign their checkpoints with the key every reader checks: ``MLSTM_CHECKPOINT_KEY`` reaches
    them with this process's environment (torchrun, Slurm's ``--export=ALL``, a pod's Secret), else
    they read the key file under MLSTM_HOME, made here before any rank starts. A pod sees no file of
    this machine's, so a Kubernetes job is refused without the variable."""
    if launcher == "kubernetes" and settings.checkpoint_key is None:
        raise ValueError(
            f"--launcher kubernetes needs {signing.KEY_VARIABLE} set here and in the pods' Secret "
            f"(MLSTM_K8S_SECRET): a pod cannot read this machine's key file "
            f"{signing.key_file(settings.home)}, so its checkpoints would be signed with a key no "
            'reader here has (docs/operations.md, "Who may write what")'
        )
    if launcher != "kubernetes" and settings.checkpoint_key is None:
        signing.home_key(settings.home)  # made once, here, before ranks on several nodes race for it
    env = {
        "MLSTM_MLFLOW_TRACKING_URI": settings.resolved_mlflow_tracking_uri,
        "MLSTM_MLFLOW_REGISTRY_URI": settings.resolved_mlflow_registry_uri,
        "MLSTM_MLFLOW_EXPERIMENT": settings.mlflow_experiment,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_LOGGING_LEVEL": os.environ.get("MLFLOW_LOGGING_LEVEL", "WARNING"),
    }
    if launcher != "kubernetes":
        env["MLSTM_HOME"] = str(settings.home.resolve())
    if settings.s3_endpoint_url:
        env["MLSTM_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    return env
