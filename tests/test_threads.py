"""Each torch process takes its share of the cores, and a small model one thread (tasks/jobs/threads.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tasks.jobs import threads as threads_module
from tasks.jobs.threads import SMALL_WIDTH, take_share, thread_share
from tasks.jobs.world import World


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """The process's torch threads as they were, whatever a test set."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_share_of_the_cores_is_one_of_each_sharers_and_at_least_one() -> None:
    assert thread_share(cores=16, sharers=4) == 4
    assert thread_share(cores=16, sharers=3) == 5  # whole threads, never more than the cores
    assert thread_share(cores=2, sharers=1) == 2
    assert thread_share(cores=2, sharers=4) == 1


def test_a_small_model_takes_one_thread_and_a_large_one_its_share() -> None:
    assert thread_share(cores=16, sharers=2, width=64) == 1  # tiny
    assert thread_share(cores=16, sharers=2, width=SMALL_WIDTH) == 1  # small
    assert thread_share(cores=16, sharers=2, width=4096) == 8  # the paper's
    assert thread_share(cores=16, sharers=2, width=None) == 8  # not known: the share


def test_an_explicit_count_wins_and_a_bad_one_is_refused() -> None:
    assert thread_share(cores=2, sharers=2, width=64, explicit=3) == 3
    with pytest.raises(ValueError, match="threads must be at least 1"):
        thread_share(cores=2, explicit=0)
    with pytest.raises(ValueError, match="sharers must be at least 1"):
        thread_share(cores=2, sharers=0)


def test_take_share_sets_torch_and_honours_omp_num_threads(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    monkeypatch.setattr(threads_module, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert take_share(sharers=2) == 4 and torch.get_num_threads() == 4
    assert take_share(sharers=2, width=64) == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set by hand (or by torchrun, or the test workers)
    assert take_share(sharers=2, width=64) == 3 and torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "many")  # not a count: the rule
    assert take_share(sharers=2) == 4


def test_a_job_rank_takes_its_share_of_the_node_then_one_thread_for_a_small_model(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    """torchrun says how many ranks share the node (LOCAL_WORLD_SIZE): each takes cores ÷ ranks at set-up,
    then one thread once the job knows its model is small."""
    monkeypatch.setattr(threads_module, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a world of one rank here: no process group needed
    world = World.from_env()
    assert world.local_size == 2 and torch.get_num_threads() == 4
    assert world.take_threads(4096) == 4 and world.take_threads(64) == 1 and torch.get_num_threads() == 1


class _CountingWorld(World):
    """A world of one that records the widths its job sizes its threads for."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def take_threads(self, width: int) -> int:
        self.widths.append(width)
        return 1


def test_both_jobs_size_their_threads_by_their_model_s_width(
    sample_manifest: str, home: Path, tmp_path: Path
) -> None:
    """Pretraining and fine-tuning each tell their world the width of the model they train (tiny: 64),
    before they train it."""
    from finetune_helpers import early_byte_splits, tiny_checkpoint

    from tasks.finetune.config import FinetuneConfig
    from tasks.finetune.train import Trainer as FinetuneTrainer
    from tasks.pretrain.config import TrainConfig
    from tasks.pretrain.train import Trainer as PretrainTrainer
    from tasks.settings import get_settings

    settings = get_settings(home=home)
    store = str(home / "store")
    world = _CountingWorld()
    PretrainTrainer(
        TrainConfig(corpus=sample_manifest, preset="tiny", run_name="t", store=store, tracking="off"),
        world,
        settings,
    )
    assert world.widths == [64]
    world = _CountingWorld()
    checkpoint = tiny_checkpoint(home / "store")
    data = early_byte_splits(tmp_path / "early")
    config = FinetuneConfig(
        checkpoint=checkpoint,
        dataset=f"early={data}",
        run_name="f",
        store=store,
        tracking="off",
        batch_size=8,
    )
    FinetuneTrainer(config, world, settings)
    assert world.widths == [64]


def test_the_transfer_stage_reads_a_small_model_s_features_on_one_thread(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None, tmp_path: Path
) -> None:
    """The features path runs in the stage's own process, not a job: it sizes that process's threads."""
    from models.mlstm import MLSTM, tiny
    from tasks.store import open_store
    from tasks.transfer.features import write_features

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    write_features(open_store(str(tmp_path)), "f.arrow", MLSTM(tiny()), ["good", "bad"], batch_size=2)
    assert torch.get_num_threads() == 1
