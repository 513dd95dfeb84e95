"""Rules of a training run seen where the trainer applies them, not in their helpers alone: the learning
rate each step's Adam uses under warm-up and decay, and each row's carried state started over at an
epoch boundary (and only there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.pretrain.config import TrainConfig


def trainer(manifest: str, home: Path, **settings: Any) -> Any:
    from tasks.jobs.world import World
    from tasks.pretrain.train import Trainer
    from tasks.settings import get_settings

    config = TrainConfig(
        corpus=manifest, preset="tiny", run_name="rules", store=str(home / "store"), tracking="off",
        precision="fp32", **settings,
    )  # fmt: skip
    return Trainer(config, World(), get_settings(home=home))


def test_each_steps_adam_uses_the_warmed_up_and_decayed_learning_rate(
    sample_manifest: str, home: Path
) -> None:
    # Written out here, not through lr_factor: linear warm-up over 3 steps, then linear decay to zero at 10.
    lr, warmup, total = 2e-3, 3, 10
    expected = [lr * min(1.0, (step + 1) / warmup) * (1.0 - step / total) for step in range(6)]
    run = trainer(
        sample_manifest, home, batch_size=8, seq_len=32, lr=lr, warmup_steps=warmup, total_steps=total
    )
    used = []
    for _ in expected:
        used.append([float(group["lr"]) for group in run.optimizer.param_groups])
        run.train_step()
    assert used == [[pytest.approx(value, rel=1e-12)] for value in expected]


def test_a_warmup_share_warms_up_over_that_share_of_a_schedule_the_data_sets(
    sample_manifest: str, home: Path
) -> None:
    # No --total-steps: the schedule is one pass over the train split; the warm-up a quarter of it.
    lr = 2e-3
    run = trainer(sample_manifest, home, batch_size=256, seq_len=32, lr=lr, warmup_share=0.25)
    total = run.plan.steps_per_epoch
    warmup = round(0.25 * total)
    assert total >= 8 and warmup >= 2, (total, warmup)
    expected = [lr * min(1.0, (step + 1) / warmup) * (1.0 - step / total) for step in range(warmup + 2)]
    used = []
    for _ in expected:
        used.append([float(group["lr"]) for group in run.optimizer.param_groups])
        run.train_step()
    assert used == [[pytest.approx(value, rel=1e-12)] for value in expected]


def test_the_carried_state_starts_over_at_an_epoch_boundary_and_only_there(
    sample_manifest: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.pretrain.train as job

    # Rows wide enough that an epoch of the sample corpus is a few steps.
    run = trainer(sample_manifest, home, batch_size=256, seq_len=128, lr=1e-3)
    per_epoch = run.plan.steps_per_epoch
    assert 2 <= per_epoch <= 12, per_epoch
    carried_in: list[float] = []  # the size of the state each step starts from

    def recorded(*args: Any, **kwargs: Any) -> Any:
        state = args[5]
        carried_in.append(sum(float(t.abs().sum()) for t in state))
        return step(*args, **kwargs)

    step = job.optimizer_step
    monkeypatch.setattr(job, "optimizer_step", recorded)
    for _ in range(per_epoch + 2):
        run.train_step()
    assert carried_in[0] == 0.0  # the first step starts from nothing
    assert all(value > 0 for value in carried_in[1:per_epoch]), carried_in
    assert carried_in[per_epoch] == 0.0, carried_in  # the first step of the second epoch starts over
    assert carried_in[per_epoch + 1] > 0, carried_in
    assert torch.is_tensor(run.state[0])
