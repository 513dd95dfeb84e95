"""Deploy ``infra/prefect.yaml`` to a Prefect server: its work pools and concurrency limits first, then
every deployment, checked to exist afterwards.

``prefect deploy`` skips a deployment whose work pool is missing with a warning and exit code 0, and
knows nothing of global concurrency limits; both live in the file's ``definitions`` section (which
Prefect keeps for YAML anchors and otherwise ignores), and this module creates them idempotently.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml


class DeployError(RuntimeError):
    """The deployment file or the server refused something; the message says what."""


def read_prefect_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DeployError(f"{path}: no such file; pass --file with the path of infra/prefect.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise DeployError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict) or not data.get("deployments"):
        raise DeployError(f"{path}: no `deployments:` list")
    return data


def deployment_names(data: dict[str, Any], root: Path) -> list[str]:
    """``flow-name/deployment-name`` of every deployment, as `prefect deployment run` takes them."""
    from prefect.flows import Flow, load_flow_from_entrypoint

    names = []
    for deployment in data["deployments"]:
        path, _, function = deployment["entrypoint"].partition(":")
        flow: Flow[..., Any] = load_flow_from_entrypoint(f"{root / path}:{function}")
        names.append(f"{flow.name}/{deployment['name']}")
    return names


def ensure_work_pools(pools: list[dict[str, Any]]) -> list[str]:
    """Create the work pools that are missing and set every pool's concurrency limit; returns what it did."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    done = []
    with get_client(sync_client=True) as client:
        for pool in pools:
            name, limit = pool["name"], pool.get("concurrency_limit")
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                client.create_work_pool(
                    WorkPoolCreate(
                        name=name,
                        type=pool.get("type", "process"),
                        description=pool.get("description"),
                        concurrency_limit=limit,
                    )
                )
                done.append(f"created work pool {name} ({pool.get('type', 'process')})")
                continue
            client.update_work_pool(
                name, WorkPoolUpdate(concurrency_limit=limit, description=pool.get("description"))
            )
            done.append(f"work pool {name} exists")
    return done


def ensure_concurrency_limits(limits: list[dict[str, Any]]) -> list[str]:
    """Create or update global concurrency limits by name; returns what it did."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    done = []
    with get_client(sync_client=True) as client:
        for limit in limits:
            name, slots = limit["name"], int(limit["limit"])
            try:
                client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
                done.append(f"created concurrency limit {name} = {slots}")
                continue
            client.update_global_concurrency_limit(
                name, GlobalConcurrencyLimitUpdate(limit=slots, active=True)
            )
            done.append(f"concurrency limit {name} = {slots}")
    return done


def run_prefect_deploy(path: Path, names: list[str], *, cwd: Path) -> str:
    """``prefect --no-prompt deploy`` for the named deployments (all when empty); returns its output."""
    command = [
        str(Path(sys.executable).parent / "prefect"),
        "--no-prompt",
        "deploy",
        "--prefect-file",
        str(path),
    ]
    command += [arg for name in names for arg in ("--name", name)] if names else ["--all"]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise DeployError(
            f"`{' '.join(command)}` failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
        )
    return done.stdout + done.stderr


def missing_deployments(expected: list[str]) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    missing = []
    with get_client(sync_client=True) as client:
        for name in expected:
            try:
                client.read_deployment_by_name(name)
            except ObjectNotFound:
                missing.append(name)
    return missing


def deploy(path: Path, only: list[str] | None = None) -> list[str]:
    """Everything ``path`` declares, against the Prefect API in force; returns lines of what it did."""
    data = read_prefect_file(path)
    definitions = data.get("definitions") or {}
    lines = ensure_work_pools(definitions.get("work_pools", []))
    lines += ensure_concurrency_limits(definitions.get("concurrency_limits", []))
    # Entrypoints are relative to the repository root (infra/'s parent), where workers run them too.
    root = path.resolve().parent.parent
    declared = {d["name"] for d in data["deployments"]}
    unknown = sorted(set(only or []) - declared)
    if unknown:
        raise DeployError(
            f"{path} declares no deployment {', '.join(unknown)} (it has {', '.join(sorted(declared))})"
        )
    run_prefect_deploy(path, list(only or []), cwd=root)
    expected = [name for name in deployment_names(data, root) if not only or name.split("/")[1] in only]
    missing = missing_deployments(expected)
    if missing:
        raise DeployError(f"`prefect deploy` ran but the server has no {', '.join(missing)}")
    return lines + [f"deployed {name}" for name in expected]
