"""What infra/prefect.yaml declares must load: every deployment's flow and parameters, as `prefect deploy`
reads them, and the pools and limits `mlstm-sentiment deploy` creates first."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())


@pytest.mark.parametrize("deployment", PREFECT_FILE["deployments"], ids=lambda d: d["name"])
def test_deployment_entrypoint_and_parameters_load(deployment: dict) -> None:
    from prefect.flows import load_flow_from_entrypoint

    path, _, name = deployment["entrypoint"].partition(":")
    flow = load_flow_from_entrypoint(f"{ROOT / path}:{name}")
    # The flow's own validation: what a run of the deployment gets, nested models and all.
    validated = flow.validate_parameters(deployment["parameters"])
    assert set(deployment["parameters"]) <= set(validated)  # the rest take their defaults
    pools = {pool["name"] for pool in PREFECT_FILE["definitions"]["work_pools"]}
    assert deployment["work_pool"]["name"] in pools, "`mlstm-sentiment deploy` would not create this pool"
    for schedule in deployment.get("schedules", []):
        assert len(schedule["cron"].split()) == 5


def test_the_gpu_pool_and_the_training_limit_allow_one_job() -> None:
    from tasks.settings import Settings

    definitions = PREFECT_FILE["definitions"]
    gpu = next(pool for pool in definitions["work_pools"] if pool["name"] == "gpu")
    assert gpu["concurrency_limit"] == 1
    limits = {limit["name"]: limit["limit"] for limit in definitions["concurrency_limits"]}
    assert limits[Settings().pretrain_concurrency_limit] == 1  # the name the pretrain flow holds


def test_the_nightly_transfer_reads_the_newest_checkpoint() -> None:
    from tasks.pipeline import PipelineParams

    nightly = next(d for d in PREFECT_FILE["deployments"] if d["name"] == "transfer-nightly")
    params = PipelineParams.model_construct(**nightly["parameters"]["params"])
    assert params.stages == ["transfer"] and params.checkpoint_uri == "newest"


def test_the_weekly_pipeline_runs_incrementally() -> None:
    """The Monday run grows the champion's corpus and continues its checkpoint (tests/test_weekly.py)."""
    from tasks.pipeline import PipelineParams

    weekly = next(d for d in PREFECT_FILE["deployments"] if d["name"] == "pipeline-weekly")
    params = PipelineParams.model_validate(weekly["parameters"]["params"])
    assert params.incremental and params.replay == 0.5
    assert "pretrain" in params.stages and "corpus" in params.stages
