"""Launchers: take a job spec (the torchrun job's flags, nodes, GPUs) and hand on a handle to watch,
read logs from and cancel, whether the job runs here, under Slurm or on Kubernetes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.jobs.launchers.base import Launcher

NAMES = ("local", "slurm", "kubernetes")


def launcher_for(name: str) -> Launcher:
    """The launcher of a name: ``local``, ``slurm`` or ``kubernetes``.

    Each is imported only when asked for: the Kubernetes client is slow to import and absent from
    machines that never use it.
    """
    if name == "local":
        from tasks.jobs.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "slurm":
        from tasks.jobs.launchers.slurm import SlurmLauncher

        return SlurmLauncher()
    if name == "kubernetes":
        from tasks.jobs.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher()
    raise ValueError(f"unknown launcher {name!r}: choose {', '.join(NAMES)}")
