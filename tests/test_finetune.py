"""Fine-tuning (tasks/finetune/): the job under torchrun, its resume, its ranks, its frozen mode, the
registered classifier, and the datasets it refuses.

The data is made so that the frozen probe cannot separate it and fine-tuning can: the label is the
first letter of the text ("a" or "b"), followed by 40 random letters. The probe reads the final cell
state, and a tiny mLSTM (here its initial weights, saved as a pretraining checkpoint) forgets the first
byte within a few steps (its forget gates start near σ(0) = ½); fine-tuning with max pooling over the
cell states can find it at the start.
"""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import cli_in_process
from finetune_helpers import early_byte_splits, tiny_checkpoint, write_split
from train_helpers import job

from tasks.finetune.config import FinetuneConfig, FinetuneParams

# The fine-tuned model's dev accuracy is above the frozen probe's by at least this much (measured: 1.0
# against about 0.55).
MARGIN = 0.3
EPOCHS, BATCH = 2, 16
SETTINGS = {"pool": "max", "epochs": EPOCHS, "batch_size": BATCH, "lr": 3e-3}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A home with the tiny checkpoint, the early-byte dataset, and one fine-tuning run of it through the
    stage: planned, launched under torchrun, watched, registered in MLflow (SQLite in the home)."""
    from tasks.finetune.stage import job_result, open_mlflow_run, plan_job, register_result
    from tasks.jobs.launchers.local import LocalLauncher
    from tasks.jobs.watch import watch
    from tasks.settings import get_settings

    root = tmp_path_factory.mktemp("finetune")
    data = early_byte_splits(root / "early")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(root / "home"))
        patch.setenv("MLSTM_MODEL_NAME", "finetune-test")
        checkpoint = tiny_checkpoint(root / "home" / "store")
        settings = get_settings()
        params = FinetuneParams(checkpoint=checkpoint, dataset=f"early={data}", run="straight", **SETTINGS)
        planned = plan_job(params, settings)
        planned = planned.tracked_by(open_mlflow_run(planned, settings, {"stage": "finetune"}))
        launcher = LocalLauncher()
        watch(launcher, launcher.submit(planned.spec), on_line=lambda _: None, on_progress=lambda _: None)
        result = register_result(planned, job_result(planned, settings), settings)
        yield {"root": root, "data": data, "checkpoint": checkpoint, "job": planned, "result": result}


def in_process(world: dict[str, Any], run: str, **changes: Any) -> dict[str, Any]:
    """The job's ``fit`` on one rank in this process, into the module's store, without MLflow."""
    from tasks.finetune.train import fit
    from tasks.jobs.world import World
    from tasks.settings import get_settings

    config = world["job"].config.model_copy(
        update={"run_name": run, "tracking": "off", "mlflow_run_id": None}
    )
    config = FinetuneConfig(**{**config.model_dump(), **changes})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(world["root"] / "home"))
        return fit(config, World(), get_settings())


def weights(world: dict[str, Any], key: str) -> dict[str, torch.Tensor]:
    from tasks.finetune.train import finetune_store, load_classifier
    from tasks.settings import Settings

    store = finetune_store(str(world["root"] / "home" / "store"), Settings())
    return load_classifier(store, key).model.state_dict()


def last_epoch_key(run: str) -> str:
    return f"runs/{run}/epochs/epoch-{EPOCHS:03d}"


def test_finetuning_beats_the_frozen_probe_where_the_final_state_forgets(world: dict[str, Any]) -> None:
    result = world["result"]
    probe = result.report.probe
    assert probe is not None and probe.dev_accuracy < 0.7, (
        probe
    )  # the final cell state has forgotten the first byte
    assert result.dev_accuracy >= probe.dev_accuracy + MARGIN, (result.dev_accuracy, probe)
    assert result.test_accuracy >= probe.test_accuracy + MARGIN


def test_each_epoch_is_in_mlflow_and_the_version_carries_its_lineage_and_card(world: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    from tasks.settings import get_settings
    from tasks.tracking import connect

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(world["root"] / "home"))
        connect(get_settings())
        client = MlflowClient()
        result = world["result"]
        for metric in ("train_loss", "dev_accuracy", "aux_lm_loss", "lr"):
            history = client.get_metric_history(result.run_id, metric)
            assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1)), metric
        version = client.get_model_version("finetune-test", str(result.registered.version))
    tags = version.tags
    assert tags["method"] == "finetune" and tags["checkpoint_uri"] == world["checkpoint"]
    assert tags["dataset_checksum"] == result.checksum
    assert json.loads(tags["finetune_settings"])["pool"] == "max"
    assert "frozen L1 probe" in version.description and "TF-IDF" in version.description
    assert "cut at the front" in version.description


def test_the_frozen_probe_reads_its_features_in_the_job_s_precision(world: dict[str, Any]) -> None:
    """A bf16 job's model card compares it with a probe of bf16 features, and says so."""
    from tasks.finetune.stage import frozen_probe, model_card
    from tasks.settings import get_settings

    job = world["job"]
    in_bf16 = job.model_copy(update={"config": job.config.model_copy(update={"precision": "bf16"})})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(world["root"] / "home"))
        probe = frozen_probe(in_bf16, get_settings())
    report = world["result"].report
    assert report.probe is not None and report.probe.features_precision == "fp32"  # auto on a CPU
    assert probe.features_precision == "bf16"
    assert abs(probe.dev_accuracy - report.probe.dev_accuracy) <= 0.05
    assert "| frozen L1 probe, same checkpoint, features in bf16 |" in model_card(
        report.model_copy(update={"probe": probe})
    )
    assert "| frozen L1 probe, same checkpoint |" in model_card(report)


def test_the_registered_model_predicts_as_the_trainer_scored(world: dict[str, Any]) -> None:
    """The pyfunc (what serving and `predict` load) gives the job's own test accuracy and probabilities."""
    import mlflow.pyfunc
    import pandas as pd

    from tasks.finetune.train import finetune_store, load_classifier
    from tasks.settings import get_settings
    from tasks.tracking import connect
    from tasks.transfer.datasets import load_dataset

    result = world["result"]
    data = load_dataset(f"early={world['data']}")
    test = data.test
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(world["root"] / "home"))
        settings = get_settings()
        connect(settings)
        model = mlflow.pyfunc.load_model(result.model_uri)
        served = model.predict(pd.DataFrame({"text": test.texts}))
        served_dev = model.predict(pd.DataFrame({"text": data.dev.texts}))
        trained = load_classifier(
            finetune_store(settings.resolved_store_uri, settings), result.classifier_key
        )
        said = cli_in_process(["predict", "--model", result.model_uri, "--json", test.texts[0]])
        in_bf16 = model.predict(pd.DataFrame({"text": test.texts}), params={"precision": "bf16"})
    accuracy = float(((served["probability"].to_numpy() >= 0.5) == test.labels).mean())
    assert accuracy == result.test_accuracy
    assert result.test_seconds is not None and result.test_seconds > 0  # the read of test, timed
    # Dev as the job scored it in memory, at the threshold it chose: the saved model folds it in.
    dev_accuracy = float(((served_dev["label"] == "positive").to_numpy() == data.dev.labels).mean())
    assert dev_accuracy == result.dev_accuracy
    np.testing.assert_allclose(served["probability"].to_numpy(), trained.predict_proba(test.texts), rtol=1e-6)
    assert said.returncode == 0, said.stderr
    line = json.loads(said.stdout.splitlines()[0])
    assert line["probability"] == pytest.approx(served["probability"][0], rel=1e-6)
    # Read in bf16 when asked (the trainer's own scores are fp32 on every device): near, not equal.
    assert not np.array_equal(in_bf16["probability"], served["probability"])
    np.testing.assert_allclose(in_bf16["probability"], served["probability"], atol=0.02)


@pytest.mark.slow  # two torchrun ranks: about 10 s
def test_two_ranks_train_what_one_does(world: dict[str, Any]) -> None:
    args = world["job"].config.model_copy(
        update={"run_name": "two", "tracking": "off", "mlflow_run_id": None}
    )
    launcher, handle = job(
        args.to_args(), world["root"] / "home", nproc=2, name="two", env={}, module="tasks.finetune.train"
    )
    status = launcher.wait(handle, poll_seconds=0.2, timeout=300)
    assert status.exit_code == 0, Path(handle.log_path).read_text()
    one, two = weights(world, last_epoch_key("straight")), weights(world, last_epoch_key("two"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)


def test_a_sigterm_checkpoints_and_the_resumed_run_equals_an_uninterrupted_one(world: dict[str, Any]) -> None:
    """A real SIGTERM to this process in the job's second epoch; a relaunch of the same run resumes
    from the checkpoint it wrote, and ends with the weights an uninterrupted run has, bit for bit."""
    from tasks.finetune.train import finetune_store
    from tasks.jobs.checkpoint import read_latest
    from tasks.settings import Settings

    store = finetune_store(str(world["root"] / "home" / "store"), Settings())
    in_process(world, "uninterrupted")

    def signal_in_the_second_epoch() -> None:
        # Past the first epoch's end: a resume must find the second epoch's order of rows, not the first's.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            latest = read_latest(store, "interrupted")
            if latest is not None and latest["step"] > world["job"].total_steps // EPOCHS:
                break
            time.sleep(0.01)
        signal.raise_signal(signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=signal_in_the_second_epoch)
    try:
        sender.start()
        stopped = in_process(world, "interrupted", checkpoint_every=2)
        sender.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped["preempted"] and stopped["steps"] < stopped["total_steps"], stopped
    resumed = in_process(world, "interrupted", checkpoint_every=2)
    assert not resumed["preempted"] and resumed["epochs"] == [
        {**epoch, "key": epoch["key"].replace("uninterrupted", "interrupted"),
         "uri": epoch["uri"].replace("uninterrupted", "interrupted")}
        for epoch in in_process_result(world, "uninterrupted")["epochs"]
    ]  # fmt: skip
    one, two = weights(world, last_epoch_key("uninterrupted")), weights(world, last_epoch_key("interrupted"))
    for name in one:
        assert torch.equal(one[name], two[name]), name


def in_process_result(world: dict[str, Any], run: str) -> dict[str, Any]:
    from tasks.finetune.train import RESULT, finetune_store
    from tasks.settings import Settings

    store = finetune_store(str(world["root"] / "home" / "store"), Settings())
    return dict(json.loads(store.read_bytes(f"runs/{run}/{RESULT}")))


def test_an_epochs_batches_are_of_like_length_yet_shuffled_and_a_function_of_the_epoch() -> None:
    """Sorted groups of batches (the default) waste little on padding where random batches waste half,
    while every row is still read once an epoch and the order changes with the epoch alone."""
    from tasks.finetune.config import FinetuneSettings
    from tasks.finetune.train import epoch_batches

    lengths_N = np.minimum(np.random.default_rng(1).lognormal(4.5, 0.5, 6920).astype(np.int64) + 1, 512)
    B, group = 32, FinetuneSettings().sort_batches

    def read(batches: np.ndarray) -> float:
        """The share of the steps a batch takes that read a text's own bytes (the rest is padding)."""
        return float(lengths_N[batches].sum() / (lengths_N[batches].max(axis=1) * B).sum())

    batches = epoch_batches(lengths_N, B, seed=0, epoch=0, group=group)
    assert batches.shape == (len(lengths_N) // B, B)
    assert len(np.unique(batches)) == batches.size  # each row at most once; the remainder left out
    assert read(batches) > 0.9 > 0.6 > read(epoch_batches(lengths_N, B, seed=0, epoch=0, group=1))
    longest = lengths_N[batches].max(axis=1)
    # The lengths come shuffled, not rising through each group: about half the steps are shorter than the last.
    assert np.count_nonzero(np.diff(longest) < 0) > len(longest) / 4
    np.testing.assert_array_equal(batches, epoch_batches(lengths_N, B, seed=0, epoch=0, group=group))
    again = epoch_batches(lengths_N, B, seed=0, epoch=1, group=group)
    assert not np.array_equal(np.sort(batches, axis=1), np.sort(again, axis=1))  # other texts meet


def test_lm_lr_factor_moves_the_mlstm_by_that_fraction_of_the_head_s_rate(world: dict[str, Any]) -> None:
    """Discriminative fine-tuning: with --lm-lr-factor f, a first Adam step from the same weights on the
    same batch moves every mLSTM weight by f times what it moves at f = 1 (Adam's first step is the rate
    times g/(|g| + eps), and the gradients are the same), and the head exactly as far; the schedule keeps
    the ratio at later steps."""
    from tasks.finetune.train import Trainer
    from tasks.jobs.world import World
    from tasks.settings import get_settings

    def stepped(run: str, factor: float, steps: int) -> Trainer:
        config = world["job"].config.model_copy(
            # An auxiliary loss, so the read-out to bytes trains too (the default has none).
            update={
                "run_name": run, "tracking": "off", "mlflow_run_id": None, "lm_lr_factor": factor,
                "aux_lm_weight": 0.1,
            }
        )  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLSTM_HOME", str(world["root"] / "home"))
            trainer = Trainer(FinetuneConfig(**config.model_dump()), World(), get_settings())
        for _ in range(steps):
            trainer.train_step()
        return trainer

    before = {k: v.clone() for k, v in stepped("f1-0", 1.0, 0).model.state_dict().items()}
    one = stepped("f1", 1.0, 1).model.state_dict()
    quarter_trainer = stepped("f025", 0.25, 1)
    quarter = quarter_trainer.model.state_dict()
    moved = [name for name in before if name.startswith("lm.") and not torch.equal(one[name], before[name])]
    assert "lm.w_x" in moved and "lm.out.weight" in moved, moved  # the aux loss trains the read-out too
    for name in moved:
        expected = 0.25 * (one[name] - before[name])
        # Within float32's rounding of the weights themselves (an ulp of values near 1 is 1.2e-7), far
        # below the steps (a quarter of the first step's rate, 3e-3 / 32: 2.3e-5).
        torch.testing.assert_close(quarter[name] - before[name], expected, rtol=1e-3, atol=2e-7, msg=name)
        assert expected.abs().max() > 1e-5, name
    for name in (n for n in before if n.startswith("head.")):
        torch.testing.assert_close(quarter[name], one[name], rtol=0, atol=0, msg=name)
    for _ in range(3):
        quarter_trainer.train_step()
    head_lr, lm_lr = quarter_trainer.schedule.get_last_lr()
    assert lm_lr == pytest.approx(0.25 * head_lr)


def test_freeze_lm_refuses_an_aux_loss_given() -> None:
    from pydantic import ValidationError

    assert (
        FinetuneParams.model_validate({"checkpoint": "c", "dataset": "d=e", "freeze_lm": True}).aux_lm_weight
        == 0
    )
    with pytest.raises(ValidationError, match=r"--aux-lm-weight 0\.1 with --freeze-lm"):
        FinetuneParams(checkpoint="c", dataset="d=e", freeze_lm=True, aux_lm_weight=0.1)


def test_freeze_lm_leaves_every_mlstm_weight_as_the_checkpoint_has_it(world: dict[str, Any]) -> None:
    from tasks.jobs.checkpoint import load_checkpoint

    in_process(world, "frozen", freeze_lm=True, aux_lm_weight=0.0, epochs=1)
    trained = weights(world, "runs/frozen/epochs/epoch-001")
    pretrained = load_checkpoint(world["checkpoint"]).state["model"]
    for name, tensor in pretrained.items():
        assert torch.equal(trained[f"lm.{name}"], tensor), name
    assert trained["head.weight"].abs().sum() > 0  # the head did train


@pytest.mark.parametrize(
    ("rows", "header", "said"),
    [
        ([("a good one", 1), ("another good one", 1)], ("text", "label"), "only positive labels"),
        ([("a good one", 1), ("a bad one", 0)], ("text", "stars"), "label"),
        ([("a good one", 1), ("   ", 0)], ("text", "label"), "is empty"),
    ],
    ids=["one class", "no label column", "an empty text"],
)
def test_a_bad_dataset_is_one_line_naming_it_before_any_work(
    tmp_path: Path, rows: list[tuple[str, int]], header: tuple[str, ...], said: str
) -> None:
    checkpoint = tiny_checkpoint(tmp_path / "elsewhere")
    bad = tmp_path / "bad.csv"
    write_split(bad, [(f"{t} {i}" if t.strip() else t, y) for i in range(20) for t, y in rows], header)
    home = tmp_path / "home"
    args = ["finetune", "--checkpoint", checkpoint, "--dataset", f"bad={bad}"]
    answer = cli_in_process(args, env={"MLSTM_HOME": str(home)})
    assert answer.returncode == 2, answer.stdout + answer.stderr
    lines = answer.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and said in lines[0], answer.stderr
    assert not (home / "store").exists() and not (home / "jobs").exists()  # nothing launched or written


def test_score_scores_and_explain_refuses_a_fine_tuned_model_in_one_line(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """The batch scorer gives the pyfunc's probabilities (no sentiment unit: NaN), telling its caller batch
    by batch; `explain`, which reads a probe's unit, says in one line why it cannot."""
    import pyarrow.parquet as pq

    from tasks.finetune.train import finetune_store, load_classifier
    from tasks.score.scoring import describe_inputs, plan_scoring, score_piece
    from tasks.score.tracking import resolve_model
    from tasks.settings import get_settings
    from tasks.transfer.datasets import load_dataset

    test = load_dataset(f"early={world['data']}").test
    reviews = tmp_path / "reviews.csv"
    write_split(reviews, [(text, 0) for text in test.texts[:20]])
    version = world["result"].registered.version
    uri = f"models:/finetune-test/{version}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(world["root"] / "home"))
        patch.setenv("MLSTM_MODEL_NAME", "finetune-test")
        plan = plan_scoring(
            describe_inputs([str(reviews)]), str(tmp_path / "out"), resolve_model(uri, get_settings())
        )
        scored = score_piece(plan, plan.pieces[0])
        plan_bf16 = plan_scoring(
            describe_inputs([str(reviews)]),
            str(tmp_path / "out"),
            resolve_model(uri, get_settings()),
            precision="bf16",
        )
        told: list[int] = []  # the bar and the stop check see each batch, not the piece's end alone
        scored_bf16 = score_piece(
            plan_bf16, plan_bf16.pieces[0], batch_size=8, on_batch=lambda rows, _bytes: told.append(rows)
        )
        said = cli_in_process(["explain", "--model", uri, "a fine film"])
        # `predict --explain` refuses before scoring: a text the model itself would refuse (too long)
        # still gets the fine-tuned line, not the length one.
        explained = cli_in_process(["predict", "--explain", "--model", uri, "long " * 200_000])
        settings = get_settings()
        expected = load_classifier(
            finetune_store(settings.resolved_store_uri, settings), world["result"].classifier_key
        ).predict_proba(test.texts[:20])
    assert said.returncode == 2 and len(said.stderr.strip().splitlines()) == 1, said.stderr
    assert "fine-tuned" in said.stderr
    assert explained.returncode == 2 and len(explained.stderr.strip().splitlines()) == 1, explained.stderr
    assert "fine-tuned" in explained.stderr
    table = pq.read_table(io.BytesIO(plan.store().read_bytes(scored["files"][0]["key"])))
    np.testing.assert_allclose(table.column("probability").to_numpy(), expected, rtol=1e-6)
    assert np.isnan(table.column("sentiment_unit").to_numpy(zero_copy_only=False)).all()
    # --precision bf16 reaches a fine-tuned model too: another output, near fp32's, not equal.
    assert plan_bf16.output != plan.output
    in_bf16 = pq.read_table(io.BytesIO(plan_bf16.store().read_bytes(scored_bf16["files"][0]["key"])))
    assert not np.array_equal(in_bf16.column("probability").to_numpy(), expected)
    np.testing.assert_allclose(in_bf16.column("probability").to_numpy(), expected, atol=0.02)
    assert told == [8, 8, 4]


@pytest.mark.slow  # `mlflow models serve` starts a server: about 15 s
def test_mlflow_serves_the_registered_fine_tuned_version_as_the_job_scored_it(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """The registered version served as a user serves the probe's (`mlflow models serve`): POSTed texts
    get the labels and probabilities of the job's own classifier."""
    from tasks.finetune.train import finetune_store, load_classifier
    from tasks.settings import get_settings
    from tasks.transfer.datasets import load_dataset
    from tasks.transfer.serve import invoke, served

    texts = load_dataset(f"early={world['data']}").test.texts[:8]
    uri = f"models:/finetune-test/{world['result'].registered.version}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(world["root"] / "home"))
        settings = get_settings()
        expected = load_classifier(
            finetune_store(settings.resolved_store_uri, settings), world["result"].classifier_key
        ).predict_proba(texts)
        with served(uri, settings.resolved_mlflow_tracking_uri, log=tmp_path / "serve.log") as url:
            predictions = invoke(url, texts)
    np.testing.assert_allclose([p["probability"] for p in predictions], expected, rtol=1e-5)
    assert [p["label"] for p in predictions] == ["positive" if p > 0.5 else "negative" for p in expected]


@pytest.mark.long  # the command in a new interpreter, through the Prefect flow: about 2 minutes
@pytest.mark.slow
def test_the_finetune_command_runs_the_flow_and_registers_a_servable_challenger(
    tmp_path: Path, prefect_api_url: str
) -> None:
    """`mlstm-sentiment finetune` end to end (the flow, the job under torchrun, the registry), then
    `predict` on the version it registered; a second run on the same data does not take `@champion`
    from a first that scored as well."""
    import os
    import subprocess
    import sys

    cli = Path(sys.executable).parent / "mlstm-sentiment"
    data = early_byte_splits(tmp_path / "early")
    home = tmp_path / "home"
    checkpoint = tiny_checkpoint(home / "store")
    env = {**os.environ, "MLSTM_HOME": str(home), "PREFECT_API_URL": prefect_api_url}
    args = [str(cli), "finetune", "--checkpoint", checkpoint, "--dataset", f"early={data}", "--pool", "max"]
    args += ["--epochs", "2", "--batch-size", "16", "--lr", "0.003", "--json"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["promoted"] and result["test_accuracy"] >= result["probe"]["test_accuracy"] + MARGIN
    said = subprocess.run(
        [str(cli), "predict", "--json", "a cdefg hijk"], env=env, capture_output=True, text=True, timeout=300
    )
    assert said.returncode == 0, said.stderr
    assert json.loads(said.stdout.splitlines()[0])["label"] == "negative"  # "a" starts the negatives
    again = subprocess.run(
        [*args[:-1], "--run", "again", "--json"], env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout.strip().splitlines()[-1])
    assert not second["promoted"]  # equal test accuracy on the same split does not beat the champion


@pytest.mark.long  # two pipeline runs through Prefect: about 2 minutes
@pytest.mark.slow
def test_the_pipelines_finetune_stage_runs_after_transfer_and_skips_when_unchanged(
    tmp_path: Path, prefect_api_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.cli.pipeline import run_pipeline
    from tasks.pipeline import FinetuneStage, PipelineParams, TransferStage

    data = early_byte_splits(tmp_path / "early")
    monkeypatch.setenv("MLSTM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PREFECT_API_URL", prefect_api_url)
    params = PipelineParams(
        stages=["transfer", "finetune"],
        checkpoint_uri=tiny_checkpoint(tmp_path / "home" / "store"),
        transfer=TransferStage(datasets=[f"early={data}"]),
        finetune=FinetuneStage(pool="max", epochs=EPOCHS, batch_size=BATCH, lr=3e-3, run="in-pipeline"),
    )
    first = run_pipeline(params, show_progress=False)
    assert first.stages["finetune"].state == "ran"
    tuned = first.finetune
    assert tuned is not None and tuned.report.probe is not None
    assert tuned.test_accuracy >= tuned.report.probe.test_accuracy + MARGIN
    # The fine-tuned version beats the probe the transfer stage registered first: it is the champion.
    assert tuned.registered.promoted, tuned.registered
    again = run_pipeline(params, show_progress=False)
    assert again.stages["finetune"].state == "skipped"
    assert again.finetune is not None and again.finetune.registered.version == tuned.registered.version
