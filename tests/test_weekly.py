"""The weekly run (``pipeline --incremental``): with no champion it is a full run and says so; the next
week grows the champion's corpus by the new source and continues pretraining from the champion's
checkpoint; a week with nothing new skips every stage, whether the challenger beat the champion or not. Real Prefect (the test harness's API), MLflow on
a SQLite file and torchrun, in this process, on the tiny preset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli_in_process

from tasks.corpus.manifest import Manifest
from tasks.corpus.sample import write_labelled_sample, write_sample
from tasks.pipeline import PipelineParams, PretrainStage, TransferStage


def _params(sources: list[Path], labelled: Path) -> PipelineParams:
    return PipelineParams(
        incremental=True,
        replay=0.05,  # one row of the 16 replays: a pass over the delta stays shorter than the warm-up
        sources=[str(source) for source in sources],
        corpus={"split": (18, 1, 1)},
        # A warm-up shorter than a pass over the whole corpus (about 150 steps) and longer than one over
        # the week's delta (about 15): the continued run warms up over a share of its own schedule.
        pretrain=PretrainStage(
            batch_size=16,
            seq_len=64,
            warmup_steps=20,
            max_steps=6,
            checkpoint_every=6,
            val_every=6,
            retries=0,
        ),
        transfer=TransferStage(datasets=[f"reviews={labelled}"], baseline=False, c_min_log2=-2, c_max_log2=0),
    )


@pytest.mark.long  # four whole pipeline runs, two training tiny for 6 steps: 135 s (three) on 2 busy cores
def test_weekly_runs_grow_the_champions_corpus_continue_its_checkpoint_and_skip_when_nothing_is_new(
    home: Path, prefect_api_url: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from flows.cli.pipeline import run_pipeline
    from tasks.pretrain.stage import read_corpus_manifest
    from tasks.settings import get_settings
    from tasks.transfer.registry import promote

    old = write_sample(tmp_path / "old", num_reviews=1200, seed=1)
    # A new file of the week (a name of its own: a base source's name with other bytes is a changed one).
    generated = write_sample(tmp_path / "generated", num_reviews=300, seed=2)[0]
    new = shutil.copy(generated, tmp_path / f"week-2-{generated.name}")
    labelled = write_labelled_sample(tmp_path / "labelled", num_reviews=300)

    first = run_pipeline(_params(old, labelled), show_progress=False)
    assert {stage: info.state for stage, info in first.stages.items()} == dict.fromkeys(
        ("corpus", "pretrain", "transfer"), "ran"
    )
    assert first.incremental is not None and first.incremental.checkpoint is None
    assert any("no corpus" in line and "in full" in line for line in first.incremental.full)
    assert any("@champion yet" in line and "from scratch" in line for line in first.incremental.full)
    assert first.transfer is not None and first.transfer.registered is not None  # the first champion
    assert first.corpus is not None and first.pretrain is not None

    second = run_pipeline(_params([*old, Path(new)], labelled), show_progress=False)
    assert second.corpus is not None and second.pretrain is not None and second.incremental is not None
    assert second.stages["corpus"].state == second.stages["pretrain"].state == "ran"
    grown: Manifest = read_corpus_manifest(second.corpus.manifest_uri)
    assert grown.parent is not None and grown.parent.corpus_id == first.corpus.corpus_id
    assert grown.delta is not None and grown.delta.sources == [Path(new).name]
    assert second.incremental.corpus == first.corpus.corpus_id
    assert second.incremental.delta_rows == grown.delta.totals.kept > 0
    assert second.incremental.continued and second.incremental.full == ()
    assert second.incremental.checkpoint == first.pretrain.checkpoint_uri
    assert second.pretrain.run_id is not None
    continued = MlflowClient().get_run(second.pretrain.run_id).data
    tags = continued.tags
    assert tags["parent"] == first.pretrain.checkpoint_uri and tags["parent_run"] == first.pretrain.run
    assert continued.params["warmup_share"] == "0.1" and continued.params["warmup_steps"] == "0"
    assert int(continued.params["total_steps"]) < 20  # one pass over the delta: shorter than the warm-up
    pipeline_tags = MlflowClient().get_run(second.run_id).data.tags
    assert pipeline_tags["incremental"].startswith(
        f"delta of {grown.delta.totals.kept:,} rows on corpus {first.corpus.corpus_id}; continued from "
        f"checkpoint {first.pretrain.checkpoint_uri}"
    )

    third = run_pipeline(_params([*old, Path(new)], labelled), show_progress=False)
    assert {stage: info.state for stage, info in third.stages.items()} == dict.fromkeys(
        ("corpus", "pretrain", "transfer"), "skipped"
    )
    # The champion is the first run's checkpoint or the challenger that beat it: either way, found done.
    assert third.incremental is not None and third.incremental.found and third.incremental.delta_rows > 0

    # The other outcome of the registry's verdict, whichever the tiny models gave: last week's
    # challenger as the champion, trained on this very corpus, is the pretraining; nothing runs.
    challenger = second.transfer.registered if second.transfer is not None else None
    assert challenger is not None
    if not challenger.promoted:
        promote(challenger.version, get_settings(), reason="the other verdict")
    fourth = run_pipeline(_params([*old, Path(new)], labelled), show_progress=False)
    assert {stage: info.state for stage, info in fourth.stages.items()} == dict.fromkeys(
        ("corpus", "pretrain", "transfer"), "skipped"
    )
    assert fourth.pretrain is not None and fourth.pretrain.run == second.pretrain.run
    assert fourth.incremental is not None and not fourth.incremental.continued

    # `status` says it, newest first: the week with nothing new, then the one that grew and continued.
    shown = cli_in_process(["status", "--json"])
    lines = [json.loads(line)["incremental"] for line in shown.stdout.splitlines()]
    assert lines[0].startswith("corpus unchanged (delta of") and "nothing new since checkpoint" in lines[0]
    assert lines[2].startswith(
        f"delta of {grown.delta.totals.kept:,} rows on corpus {first.corpus.corpus_id};"
    )
