"""A run's identity survives a new setting (tasks/jobs/config.py's ``Weights``): a weight-changing setting
added with the neutral value that trains as before leaves every existing run's key as it was and lets
every existing checkpoint resume; another value of it is another run, and a resume refuses it. Without
the neutral value, the key and the resume would orphan every run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import pytest
from pydantic import Field, create_model

from tasks.finetune.config import FinetuneConfig, FinetuneParams
from tasks.jobs.config import WEIGHTS, Weights
from tasks.pipeline import finetune_key, pretrain_key
from tasks.pretrain.config import PretrainParams, TrainConfig
from tasks.settings import Settings

# The keys of today's default settings, computed before a setting could declare a neutral value: a run
# the pipeline trained or fine-tuned then is found by the same key now.
PRETRAIN_KEY = "3293ce2e50d9fae2852eba303764d8e56559607d5189415c47dffe86ed4589e2"
PRETRAIN_KEY_SMALL = (
    "ff696cd137048757a274a0ba3ff0b3c9bfb76c5dafe508b7a9651c3b6d23b899"  # preset small, lr 1e-3
)
FINETUNE_KEY = "9ab5e46ab01cac5634c155c6fcbf4906a7f882c4bc946b7d9befa95183c01dee"  # weights "w", data "d"

NEUTRAL = Annotated[float, Weights(neutral=0.0)]
ALWAYS = Annotated[float, WEIGHTS]


def added(base: type[Any], mark: Any) -> type[Any]:
    """``base`` as it would be with a weight-changing setting ``weight_decay`` (default 0.0) added."""
    field = (mark, Field(default=0.0, ge=0, description="Adam's weight decay."))
    return create_model(base.__name__, __base__=base, weight_decay=field)


def test_the_keys_of_todays_settings_are_the_ones_runs_were_trained_under() -> None:
    assert pretrain_key(PretrainParams(corpus="c"), "corpus-id") == PRETRAIN_KEY
    changed = PretrainParams(corpus="c", preset="small", lr=1e-3)
    assert pretrain_key(changed, "corpus-id") == PRETRAIN_KEY_SMALL


def test_a_setting_added_at_its_neutral_value_leaves_the_pretraining_key() -> None:
    later = added(PretrainParams, NEUTRAL)
    assert pretrain_key(later(corpus="c"), "corpus-id") == PRETRAIN_KEY
    assert pretrain_key(later(corpus="c", preset="small", lr=1e-3), "corpus-id") == PRETRAIN_KEY_SMALL
    assert pretrain_key(later(corpus="c", weight_decay=0.01), "corpus-id") != PRETRAIN_KEY
    # Without its neutral value, the new setting would rename every run (the pipeline retrains all).
    assert pretrain_key(added(PretrainParams, ALWAYS)(corpus="c"), "corpus-id") != PRETRAIN_KEY


def test_a_setting_added_at_its_neutral_value_leaves_the_finetuning_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key's weights and data stand in (``"w"``, ``"d"``): the settings are what is tested here."""
    import tasks.transfer.datasets
    import tasks.transfer.features
    import tasks.transfer.stage

    monkeypatch.setattr(
        tasks.transfer.stage, "load_checkpoint_of", lambda *_: SimpleNamespace(model=lambda: None)
    )
    monkeypatch.setattr(tasks.transfer.features, "weights_fingerprint", lambda _: "w")
    monkeypatch.setattr(
        tasks.transfer.datasets, "load_dataset", lambda *_, **__: SimpleNamespace(checksum="d")
    )
    # The defaults of the day the key was computed (concat pooling, an auxiliary loss of 0.1), given by
    # name since the defaults changed (docs/finetune.md: chosen on dev alone).
    target = {"checkpoint": "x", "dataset": "d", "pool": "concat", "aux_lm_weight": 0.1}
    assert finetune_key(FinetuneParams(**target), Settings()) == FINETUNE_KEY
    later = added(FinetuneParams, NEUTRAL)
    assert finetune_key(later(**target), Settings()) == FINETUNE_KEY
    assert finetune_key(later(**target, weight_decay=0.01), Settings()) != FINETUNE_KEY
    assert finetune_key(added(FinetuneParams, ALWAYS)(**target), Settings()) != FINETUNE_KEY


def test_a_checkpoint_saved_before_a_setting_existed_resumes_at_its_neutral_value(
    sample_manifest: str, home: Path
) -> None:
    """Through the pretraining job's own resume: a checkpoint of today's settings, relaunched by a
    config that has the new setting."""
    from tasks.jobs.world import World
    from tasks.pretrain.train import Trainer
    from tasks.settings import get_settings

    common = {
        "corpus": sample_manifest, "preset": "tiny", "run_name": "before", "store": str(home / "store"),
        "batch_size": 8, "seq_len": 32, "tracking": "off",
    }  # fmt: skip
    settings = get_settings(home=home)
    before = Trainer(TrainConfig(**common), World(), settings)
    before.train_step()
    assert before.save() is not None

    later = added(TrainConfig, NEUTRAL)
    resumed = Trainer(later(**common), World(), settings)
    assert resumed.resume() and resumed.step == 1
    with pytest.raises(ValueError, match=r"--weight-decay was 0\.0, now 0\.01"):
        Trainer(later(**common, weight_decay=0.01), World(), settings).resume()
    # Without its neutral value, the checkpoint's missing value (None) differs from any: every run refused.
    with pytest.raises(ValueError, match=r"--weight-decay was None, now 0\.0"):
        Trainer(added(TrainConfig, ALWAYS)(**common), World(), settings).resume()


def test_a_fine_tuning_checkpoint_saved_before_a_setting_existed_resumes_at_its_neutral_value(
    tmp_path: Path, home: Path
) -> None:
    """Through the fine-tuning job's own resume, as the pretraining one above."""
    from finetune_helpers import early_byte_splits, tiny_checkpoint

    from tasks.finetune.train import Trainer
    from tasks.jobs.world import World
    from tasks.settings import get_settings

    common = {
        "checkpoint": tiny_checkpoint(home / "store"), "dataset": f"early={early_byte_splits(tmp_path / 'early')}",
        "run_name": "before", "store": str(home / "store"), "batch_size": 16, "tracking": "off",
    }  # fmt: skip
    settings = get_settings(home=home)
    before = Trainer(FinetuneConfig(**common), World(), settings)
    before.train_step()
    before.save()

    later = added(FinetuneConfig, NEUTRAL)
    resumed = Trainer(later(**common), World(), settings)
    assert resumed.resume() and resumed.step == 1
    with pytest.raises(ValueError, match=r"--weight-decay was 0\.0, now 0\.01"):
        Trainer(later(**common, weight_decay=0.01), World(), settings).resume()
    with pytest.raises(ValueError, match=r"--weight-decay was None, now 0\.0"):
        Trainer(added(FinetuneConfig, ALWAYS)(**common), World(), settings).resume()


def test_a_continued_runs_key_is_its_parents_digest_not_the_name_it_was_given() -> None:
    """``--init-from champion`` and the step folder it resolves to are one parent when their checkpoint's
    digest is one; other weights behind the same name are another run. At their neutral values the
    continuing settings leave today's key."""
    by_name = pretrain_key(PretrainParams(corpus="c", init_from="champion"), "corpus-id", parent_digest="d1")
    by_uri = pretrain_key(
        PretrainParams(corpus="c", init_from="s3://b/runs/x"), "corpus-id", parent_digest="d1"
    )
    moved = pretrain_key(PretrainParams(corpus="c", init_from="champion"), "corpus-id", parent_digest="d2")
    assert by_name == by_uri != moved
    neutral = PretrainParams(corpus="c", init_from=None, init_optimizer=False, replay=0.0)
    assert pretrain_key(neutral, "corpus-id") == PRETRAIN_KEY
