"""The one optimizer builder (tasks/jobs/optim.py): every path a step runs (eager, captured, ZeRO-1)
builds the same Adam, with the job's learning rate and its ``OptimizerSettings``, as the job built it by
hand before; a field added to ``OptimizerSettings`` reaches Adam on every path and in both jobs."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.optim import ZeroRedundancyOptimizer

from tasks.finetune.config import FinetuneSettings
from tasks.jobs import optim
from tasks.jobs.config import OptimizerSettings, Weights
from tasks.jobs.optim import build_optimizer
from tasks.pretrain.config import TrainConfig, TrainSettings

PATHS = ("eager", "captured", "zero")


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A process group of one rank (gloo), which ZeroRedundancyOptimizer asks for its rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings, lr a number (a captured Adam's is a device tensor)."""
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return [
        {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in inner.param_groups
    ]


def test_every_path_builds_the_adam_the_job_built_by_hand(one_rank: None) -> None:
    """The Adam each path built before the builder (sharding.py, graphed.py), field for field."""
    model = torch.nn.Linear(3, 2)
    by_hand = {
        "eager": torch.optim.Adam(model.parameters(), lr=1e-3),
        "captured": torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3), fused=True, capturable=True),
        "zero": ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3),
    }
    for path, expected in by_hand.items():
        built = build_optimizer(model.parameters(), OptimizerSettings(), lr=1e-3, path=path)
        assert type(built) is type(expected), path
        assert hyperparameters(built) == hyperparameters(expected), path
    captured = build_optimizer(model.parameters(), OptimizerSettings(), lr=1e-3, path="captured")
    lr = captured.param_groups[0]["lr"]
    # The schedule fills this tensor in place; a float would be baked into the graph.
    assert isinstance(lr, torch.Tensor) and lr.device == model.weight.device
    zero = build_optimizer(model.parameters(), OptimizerSettings(), lr=1e-3, path="zero")
    assert isinstance(zero, ZeroRedundancyOptimizer) and type(zero.optim) is torch.optim.Adam


def test_param_groups_keep_their_own_learning_rates() -> None:
    """Fine-tuning's head and mLSTM groups (tasks/finetune/train.py's ``param_groups``)."""
    head, lm = torch.nn.Linear(3, 1), torch.nn.Linear(3, 3)
    groups = [{"params": list(head.parameters()), "lr": 1e-3}, {"params": list(lm.parameters()), "lr": 1e-4}]
    for path in ("eager", "captured"):
        built = build_optimizer(groups, OptimizerSettings(), lr=1e-3, path=path)
        assert [g["lr"] for g in hyperparameters(built)] == pytest.approx([1e-3, 1e-4]), path


def test_every_field_of_the_optimizer_settings_is_one_of_adams_keywords() -> None:
    """The builder passes each field by its name: one Adam has no such keyword would fail at launch."""
    keywords = set(inspect.signature(torch.optim.Adam).parameters) - {"params", "lr"}
    assert set(OptimizerSettings.model_fields) <= keywords
    # Both jobs' settings are optimizer settings: what they pass the builder carries every field.
    assert issubclass(TrainSettings, OptimizerSettings) and issubclass(FinetuneSettings, OptimizerSettings)


class WithDecay(OptimizerSettings):
    """``OptimizerSettings`` as it would be with weight decay added: the one line it takes."""

    weight_decay: Annotated[float, Weights(neutral=0.0)] = Field(default=0.0, ge=0)


@pytest.mark.parametrize("path", PATHS)
def test_a_setting_added_to_the_optimizer_settings_reaches_adam_on_every_path(
    path: str, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(optim, "OptimizerSettings", WithDecay)
    model = torch.nn.Linear(3, 2)
    built = build_optimizer(model.parameters(), WithDecay(weight_decay=0.01), lr=1e-3, path=path)
    assert [g["weight_decay"] for g in hyperparameters(built)] == [0.01]
    assert [g["lr"] for g in hyperparameters(built)] == pytest.approx([1e-3])


def test_the_pretraining_job_builds_its_adam_from_its_own_settings(
    sample_manifest: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's config, with a field the builder passes, reaches the trainer's Adam."""
    from tasks.jobs.world import World
    from tasks.pretrain.train import Trainer
    from tasks.settings import get_settings

    class Decayed(TrainConfig):
        weight_decay: Annotated[float, Weights(neutral=0.0)] = Field(default=0.0, ge=0)

    monkeypatch.setattr(optim, "OptimizerSettings", WithDecay)
    config = Decayed(
        corpus=sample_manifest, preset="tiny", run_name="decay", store=str(home / "store"), batch_size=8,
        seq_len=32, tracking="off", lr=2e-3, weight_decay=0.01,
    )  # fmt: skip
    trainer = Trainer(config, World(), get_settings(home=home))
    assert [(g["lr"], g["weight_decay"]) for g in trainer.optimizer.param_groups] == [(2e-3, 0.01)]
