"""Every pretraining setting a user gives reaches the trainer: ``mlstm-sentiment pretrain --FLAG`` (and the
pipeline's ``pretrain.FIELD``, the same PretrainParams) → plan_job → the job's command line → the
TrainConfig the trainer parses from it. A setting dropped on the way keeps its default silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tasks.jobs.config import LaunchSettings
from tasks.pipeline import pretrain_key
from tasks.pretrain.config import PretrainParams, TrainConfig, weight_settings
from tasks.pretrain.result import PretrainResult
from tasks.pretrain.stage import Job, plan_job
from tasks.settings import get_settings

# A value other than the default for every setting of the stage. A new setting fails the first test
# until it is given one here (and so is checked).
CHANGED: dict[str, Any] = {
    "preset": "small",
    "launcher": "local",  # the only launcher that plans without a cluster; its default anyway
    "nodes": 1,  # local runs one node
    "gpus_per_node": 0,  # this machine's; the memory check is tests/test_memory.py's
    "nproc": 2,
    "run": "reach",
    "max_steps": 7,
    "total_steps": 9,
    "batch_size": 16,
    "seq_len": 48,
    "lr": 0.00123,
    "lr_base_batch": 32,
    "lr_scaling": "sqrt",
    "warmup_steps": 3,
    "precision": "fp32",
    "clip": 0.5,
    "seed": 7,
    "init_from": "reach-parent",  # a run's name: resolved to its latest checkpoint (made by _parent)
    "init_optimizer": True,
    "replay": 0.25,
    "sharding": "optimizer",
    "gpu_memory": 40.0,
    "checkpoint_every": 5,
    "val_every": 6,
    "val_steps": 3,
    "log_every": 2,
    "retries": 1,
    "recurrence": "reference",
    "compile": "off",
    "cuda_graph": "off",
}
# Settings given in place of one of CHANGED (the two together are refused), each checked in its place.
INSTEAD: dict[str, tuple[str, Any]] = {"warmup_share": ("warmup_steps", 0.3)}
GIVEN = [
    pytest.param(CHANGED, id="changed"),
    *(
        pytest.param({**{k: v for k, v in CHANGED.items() if k != replaced}, name: value}, id=name)
        for name, (replaced, value) in INSTEAD.items()
    ),
]
# Settings of the launch, not of the trainer: where and how often it runs, checked on the Job instead.
LAUNCH_ONLY = {*LaunchSettings.model_fields, "run"}


def test_every_setting_has_a_changed_value_here() -> None:
    assert set(PretrainParams.model_fields) - {"corpus"} == set(CHANGED) | set(INSTEAD)
    defaults = PretrainParams(corpus="c")
    unchanged = [
        k for k, v in CHANGED.items() if getattr(defaults, k) == v and k not in ("launcher", "nodes")
    ]
    assert unchanged == ["gpus_per_node"]


def _parent(manifest: str, home: Path) -> str:
    """The checkpoint ``--init-from reach-parent`` names: a small model's, at step 0, on the same corpus."""
    from tasks.jobs.world import World
    from tasks.pretrain.train import Trainer

    config = TrainConfig(
        corpus=manifest, preset="small", run_name="reach-parent", store=str(home / "store"), batch_size=16,
        seq_len=48, tracking="off",
    )  # fmt: skip
    uri = Trainer(config, World(), get_settings(home=home)).save()
    assert uri is not None
    return uri


def _check_reached(job: Job, manifest: str, parent: str, given: dict[str, Any]) -> None:
    config = TrainConfig.from_args(list(job.spec.args))  # what the trainer parses from its command line
    assert config == job.config
    for name, value in given.items():
        if name not in LAUNCH_ONLY | {"init_from"}:
            assert getattr(config, name) == value, name
    assert config.init_from == parent  # the run's name, resolved to the step folder it names
    assert config.run_name == "reach" and config.corpus == str(Path(manifest).resolve())
    assert (job.spec.nodes, job.spec.nproc_per_node, job.spec.gpus_per_node) == (1, 2, 0)
    assert job.stop_step == 7 and job.total_steps == 9


@pytest.mark.parametrize("given", GIVEN)
def test_every_pretrain_setting_reaches_the_trainers_config(
    sample_manifest: str, home: Path, given: dict[str, Any]
) -> None:
    parent = _parent(sample_manifest, home)
    params = PretrainParams(corpus=sample_manifest, **given)
    _check_reached(plan_job(params, get_settings()), sample_manifest, parent, given)


@pytest.mark.parametrize("given", GIVEN)
def test_every_pretrain_flag_reaches_the_trainers_config(
    sample_manifest: str, home: Path, monkeypatch: pytest.MonkeyPatch, given: dict[str, Any]
) -> None:
    """The CLI's flags, as a user types them, up to the job that would be launched (nothing launches)."""
    import flows.cli.pretrain
    from flows.cli import app

    parent = _parent(sample_manifest, home)
    planned: list[Job] = []

    def plan_only(params: PretrainParams, **_: Any) -> PretrainResult:
        assert params.retries == CHANGED["retries"]  # read by the flow, not the trainer
        planned.append(plan_job(params, get_settings()))
        return PretrainResult(
            run="-", run_id="-", checkpoint_uri="-", steps=0, total_steps=0, final_loss=0.0, val_bpc=None
        )

    monkeypatch.setattr(flows.cli.pretrain, "run_pretrain", plan_only)
    flags = [
        f"--{name.replace('_', '-')}={value}"
        if not isinstance(value, bool)
        else f"--{'' if value else 'no-'}{name.replace('_', '-')}"  # typer's --x/--no-x
        for name, value in given.items()
    ]
    done = CliRunner().invoke(app, ["pretrain", "--corpus", sample_manifest, *flags, "--json"])
    assert done.exit_code == 0, done.output
    assert len(planned) == 1
    _check_reached(planned[0], sample_manifest, parent, given)


def test_the_pipelines_training_key_follows_exactly_the_settings_marked_as_changing_the_weights() -> None:
    """A changed setting marked WEIGHTS (tasks/pretrain/config.py) is another run; any other is the same."""
    base = PretrainParams(corpus="c")
    key = pretrain_key(base, "corpus-id")
    each = {**CHANGED, **{name: value for name, (_, value) in INSTEAD.items()}}
    changes_key = {
        name
        for name, value in each.items()
        if pretrain_key(base.model_copy(update={name: value}), "corpus-id") != key
    }
    assert changes_key == set(weight_settings()) & set(each)
    # The ones a user would name: the model, the data's shape, the optimiser, its schedule and seed.
    assert {"preset", "batch_size", "lr", "lr_base_batch", "clip", "seed", "total_steps"} <= changes_key
    assert {"init_from", "init_optimizer", "replay"} <= changes_key  # a continued run is another run
    assert not changes_key & {"max_steps", "sharding", "log_every", "recurrence", "gpu_memory", "nproc"}
