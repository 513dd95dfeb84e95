"""Run the training job (``torchrun -m tasks.pretrain.train``) from a test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.jobs.launchers.base import JobHandle, JobSpec
from tasks.jobs.launchers.local import LocalLauncher
from tasks.pretrain.stage import JOB_MODULE


def job(
    args: list[str],
    env_home: Path,
    *,
    nproc: int = 1,
    name: str = "job",
    env: dict[str, str] | None = None,
    module: str = JOB_MODULE,
) -> tuple[LocalLauncher, JobHandle]:
    """Start ``torchrun -m MODULE`` (the pretraining job by default) with ``nproc`` CPU ranks (``env`` on
    top of MLSTM_HOME)."""
    launcher = LocalLauncher()
    spec = JobSpec(
        name=name,
        args=tuple(args),
        nproc_per_node=nproc,
        module=module,
        env={"MLSTM_HOME": str(env_home), **(env or {})},
        workdir=env_home / "jobs",
    )
    return launcher, launcher.submit(spec)


def run_job(
    args: list[str], home: Path, *, nproc: int = 1, name: str = "job", env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the job to its end; its ``result`` line as a dict."""
    launcher, handle = job(args, home, nproc=nproc, name=name, env=env)
    status = launcher.wait(handle, poll_seconds=0.2, timeout=300)
    log = Path(handle.log_path).read_text()
    assert status.exit_code == 0, log
    return json.loads(log.rpartition("result ")[2].splitlines()[0])
