"""What infra/ declares must load: every deployment's flow and parameters, as `prefect deploy` reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _deployments() -> list[dict]:
    return yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("deployment", _deployments(), ids=lambda d: d["name"])
def test_deployment_entrypoint_and_parameters_load(deployment: dict) -> None:
    from prefect.flows import load_flow_from_entrypoint

    path, _, name = deployment["entrypoint"].partition(":")
    flow = load_flow_from_entrypoint(f"{ROOT / path}:{name}")
    validated = flow.validate_parameters(deployment["parameters"])
    assert validated["sources"] == deployment["parameters"]["sources"]
    assert deployment["work_pool"]["name"]
    for schedule in deployment.get("schedules", []):
        assert len(schedule["cron"].split()) == 5
