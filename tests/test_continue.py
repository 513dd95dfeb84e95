"""A continued pretraining run (``--init-from``, ``--init-optimizer``, ``--replay``): it starts from its
parent's weights on a schedule of its own, reads its replay share from the parent's corpus and the rest
from the corpus's new shards, records its parent in ``meta.json`` and MLflow, is known by its parent's
digest (so a rerun finds it), and resumes after SIGTERM as if never stopped.

The grown corpus here is made by hand (the sample corpus's shards plus a delta's, copied beside one
manifest), as ``corpus build --base`` makes one: a manifest listing the base's shards and the new ones.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from train_helpers import job, run_job

from tasks.jobs.checkpoint import checkpoint_digest, load_checkpoint, read_latest, read_meta
from tasks.jobs.world import World
from tasks.pretrain.config import PretrainParams, TrainConfig
from tasks.pretrain.mix import RowPlan, replay_rows
from tasks.pretrain.parent import find_parent
from tasks.pretrain.stage import plan_job
from tasks.pretrain.stream import BatchPlan, ByteStream, StreamError
from tasks.pretrain.train import Trainer, fit, lr_factor
from tasks.settings import get_settings
from tasks.store import LocalStore

SMALL = {"preset": "tiny", "batch_size": 8, "seq_len": 32, "lr": 0.003}
FAST = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--lr", "0.003", "--log-every", "5"]


def grown_corpus(base_uri: str, delta_uri: str, out: Path) -> str:
    """A manifest listing the base corpus's shards (unchanged, same bytes) and the delta's."""
    base, delta = (json.loads(Path(uri).read_text()) for uri in (base_uri, delta_uri))
    folder = out / "corpora" / "grown"
    manifest = copy.deepcopy(base)
    manifest["corpus_id"] = hashlib.sha256(f"{base['corpus_id']}+{delta['corpus_id']}".encode()).hexdigest()[
        :16
    ]
    for split, entry in manifest["splits"].items():
        shards = []
        for origin, uri, source in (("base", base_uri, base), ("delta", delta_uri, delta)):
            for shard in source["splits"][split]["shards"]:
                (folder / origin / shard["path"]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(uri).parent / shard["path"], folder / origin / shard["path"])
                shards.append({**shard, "path": f"{origin}/{shard['path']}"})
        entry["shards"] = shards
        for total in ("rows", "bytes", "text_bytes"):
            entry[total] = sum(shard[total] for shard in shards)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder / "manifest.json")


@pytest.fixture(scope="module")
def lineage(sample_manifest: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sample corpus (the parent's), a corpus grown from it by a delta, and a tiny parent trained
    6 steps on the first, with checkpoints at steps 3 and 6 (its schedule ends at 6: its lr there is 0)."""
    from corpus_helpers import build

    from tasks.corpus.build import CorpusConfig
    from tasks.corpus.sample import write_sample

    root = tmp_path_factory.mktemp("continue")
    files = write_sample(root / "raw", num_reviews=900, seed=1)
    delta = build(files, root / "delta", CorpusConfig(split=(18, 1, 1)))
    delta_uri = str(root / "delta" / "corpora" / delta.corpus_id / "manifest.json")
    grown = grown_corpus(sample_manifest, delta_uri, root / "store")
    config = TrainConfig(
        corpus=sample_manifest, run_name="parent", store=str(root / "store"), total_steps=6,
        checkpoint_every=3, val_every=100, tracking="off", **SMALL,
    )  # fmt: skip
    with sigterm_kept():
        result = fit(config, World(), get_settings(home=root / "home"))
    assert result.checkpoint_uri is not None
    return {"parent": result.checkpoint_uri, "store": root / "store", "base": sample_manifest, "grown": grown}


class sigterm_kept:
    """fit installs the job's SIGTERM handler; a test puts pytest's back."""

    def __enter__(self) -> None:
        self.handler = signal.getsignal(signal.SIGTERM)

    def __exit__(self, *_: object) -> None:
        signal.signal(signal.SIGTERM, self.handler)


def continued(lineage: dict[str, Any], home: Path, **settings: Any) -> TrainConfig:
    return TrainConfig(
        **{
            "corpus": lineage["grown"], "init_from": lineage["parent"], "run_name": "continued",
            "store": str(home / "store"), "val_every": 100, "tracking": "off", **SMALL, **settings,
        }
    )  # fmt: skip


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[tuple[str, ...]]]:
    """Bytes read from each byte stream of this process, by the shard files it was opened on."""
    reads: Counter[tuple[str, ...]] = Counter()
    opened, read = ByteStream.__init__, ByteStream.read

    def counting_init(self: ByteStream, paths: list[Path]) -> None:
        opened(self, paths)
        self.paths = tuple(str(p) for p in paths)  # type: ignore[attr-defined]

    def counting_read(self: ByteStream, start: int, length: int) -> np.ndarray:
        reads[self.paths] += length  # type: ignore[attr-defined]
        return read(self, start, length)

    monkeypatch.setattr(ByteStream, "__init__", counting_init)
    monkeypatch.setattr(ByteStream, "read", counting_read)
    yield reads


def test_without_replay_rows_the_plan_is_a_plain_runs_byte_for_byte() -> None:
    """A run from its own seed reads exactly what it read before continued runs existed."""
    for world_size in (1, 2):
        for rank in range(world_size):
            rows = RowPlan(5000, 0, 8, 32, (), world_size, rank)
            plain = BatchPlan(5000, 8, 32, world_size, rank)
            assert rows.steps_per_epoch == plain.steps_per_epoch
            for step in range(2 * plain.steps_per_epoch + 1):
                assert [start for _, start in rows.starts(step)] == plain.starts(step).tolist()
                boundary = step > 0 and plain.epoch_of(step) != plain.epoch_of(step - 1)
                assert rows.restarts(step).tolist() == [boundary] * len(plain.rows)


def test_replay_rows_are_the_share_drawn_by_the_seed_and_each_stream_restarts_on_its_own() -> None:
    chosen = replay_rows(16, 0.25, seed=3)
    assert len(chosen) == 4 and chosen == replay_rows(16, 0.25, seed=3)
    assert chosen != replay_rows(16, 0.25, seed=4)
    assert len(replay_rows(8, 0.0625, seed=0)) == 1  # half a row rounds up, as a share says
    with pytest.raises(StreamError, match=r"--replay 0\.05 of a batch of 8 rows rounds to no row"):
        replay_rows(8, 0.05, seed=0)
    with pytest.raises(StreamError, match="leaves no row for the new data"):
        replay_rows(8, 0.95, seed=0)
    # Two ranks share the rows: each global row once, from its own stream; the replay (10,000 bytes over 4
    # rows) and the fresh stream (2,000 over 12) start over at their own epochs.
    plans = [RowPlan(2000, 10000, 16, 32, chosen, 2, rank) for rank in (0, 1)]
    streams = [stream for plan in plans for stream, _ in plan.starts(0)]
    assert streams == [int(row in chosen) for row in range(16)]
    fresh_epoch = BatchPlan(2000, 12, 32).steps_per_epoch
    assert plans[0].steps_per_epoch == fresh_epoch
    restarted = np.concatenate([plan.restarts(fresh_epoch) for plan in plans])
    assert restarted.tolist() == [row not in chosen for row in range(16)]


def test_a_continued_run_reads_its_replay_share_from_the_parent_corpus_and_the_rest_from_the_new_shards(
    lineage: dict[str, Any], home: Path, bytes_read: Counter[tuple[str, ...]]
) -> None:
    with sigterm_kept():
        fit(continued(lineage, home, replay=0.25, total_steps=12), World(), get_settings(home=home))
    train = {paths: count for paths, count in bytes_read.items() if "/val/" not in paths[0]}
    grown = Path(lineage["grown"]).parent
    parents = tuple(
        str(Path(lineage["base"]).parent / s["path"])
        for s in json.loads(Path(lineage["base"]).read_text())["splits"]["train"]["shards"]
    )
    new = tuple(str(p) for p in sorted((grown / "delta" / "train").iterdir()))
    assert set(train) == {parents, new}  # no byte of the grown corpus's copy of the base
    share = train[parents] / (train[parents] + train[new])
    assert share == pytest.approx(0.25, abs=0.5 / 8), train  # 2 rows of 8; a row is 1/8 of the bytes


def test_a_continued_run_starts_from_the_parents_weights_on_a_schedule_of_its_own(
    lineage: dict[str, Any], home: Path
) -> None:
    parent = load_checkpoint(lineage["parent"]).state
    settings = get_settings(home=home)
    config = continued(lineage, home, warmup_steps=4, total_steps=20)
    trainer = Trainer(config, World(), settings)
    assert not trainer.resume()  # a new run: no checkpoint of its own yet
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, parent["model"][name]), name
    assert trainer.optimizer.state_dict()["state"] == {}  # Adam starts afresh unless asked
    # Re-warmed: the parent's lr ended at 0; this run's first step is the first of its own warm-up.
    first_lr = config.effective_lr() * lr_factor(0, warmup_steps=4, total_steps=20)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(first_lr)
    assert trainer.step == 0 and trainer.total_steps == 20

    taking = Trainer(continued(lineage, home, init_optimizer=True, run_name="moments"), World(), settings)
    taking.resume()
    moments = taking.optimizer.state_dict()["state"]
    for index, state in parent["optimizer"]["state"].items():
        assert torch.equal(moments[index]["exp_avg"], state["exp_avg"]), index
    assert taking.optimizer.param_groups[0]["lr"] == pytest.approx(config.effective_lr())  # its own lr


def test_a_continued_run_is_known_by_its_parents_digest_so_a_rerun_finds_it(
    lineage: dict[str, Any], monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    """The parent named by its run's name, its run folder or its step folder is one parent: one run. Another
    checkpoint is another run. A rerun with nothing changed finds the finished run and trains nothing."""
    monkeypatch.setenv("MLSTM_STORE_URI", str(lineage["store"]))
    settings = get_settings()
    common = {"corpus": lineage["grown"], "replay": 0.25, "total_steps": 4, **SMALL}
    names = {
        plan_job(PretrainParams(init_from=init_from, **common), settings).config.run_name
        for init_from in ("parent", str(lineage["store"] / "runs" / "parent"), lineage["parent"])
    }
    assert len(names) == 1
    earlier = str(Path(lineage["parent"]).with_name("step-0000003"))
    other = plan_job(PretrainParams(init_from=earlier, **common), settings)
    assert other.config.run_name not in names and other.config.init_from == earlier

    first = plan_job(PretrainParams(init_from="parent", **common), settings)
    config = first.config.model_copy(update={"tracking": "off"})
    with sigterm_kept():
        done = fit(config, World(), settings)
        again = plan_job(PretrainParams(init_from="parent", **common), settings)
        assert again.config.run_name == first.config.run_name
        rerun = fit(again.config.model_copy(update={"tracking": "off"}), World(), settings)
    assert rerun.steps == done.steps == 4 and rerun.checkpoint_uri == done.checkpoint_uri

    from flows.pretrain import continued_from  # the flow's artifact line

    line = continued_from(first)
    assert f"continued from checkpoint `{lineage['parent']}` (run parent, step 6)" in line and "25%" in line


@pytest.mark.slow  # MLflow's first database here: about 30 s on two busy cores
def test_a_run_continued_from_the_champion_records_its_parent_in_meta_json_and_mlflow(
    lineage: dict[str, Any], home: Path
) -> None:
    """``champion`` is the checkpoint behind the registered champion (its version's ``checkpoint_uri``)."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking import connect

    settings = get_settings()
    with pytest.raises(ValueError, match=r"--init-from champion: .* has no @champion"):
        find_parent("champion", settings)
    connect(settings)
    client = MlflowClient()
    client.create_registered_model(settings.model_name)
    version = client.create_model_version(
        settings.model_name, source=str(home), tags={"checkpoint_uri": lineage["parent"]}
    )
    client.set_registered_model_alias(settings.model_name, "champion", version.version)

    params = PretrainParams(
        corpus=lineage["grown"], init_from="champion", replay=0.25, max_steps=2, total_steps=12, **SMALL
    )
    planned = plan_job(params, settings)
    assert planned.config.init_from == lineage["parent"]
    with sigterm_kept():
        result = fit(planned.config, World(), settings)
    assert result.checkpoint_uri is not None
    _, parent_meta = read_meta(lineage["parent"])
    _, meta = read_meta(result.checkpoint_uri)
    recorded = meta["parent"]
    assert recorded["checkpoint_uri"] == lineage["parent"] and recorded["run"] == "parent"
    assert recorded["digest"] == checkpoint_digest(parent_meta) and recorded["step"] == 6
    assert recorded["corpus"] == lineage["base"] and meta["corpus"] == lineage["grown"]
    assert meta["replay_rows"] == 2

    run = client.get_run(str(result.run_id))
    tags, logged = run.data.tags, run.data.params
    assert tags["parent"] == lineage["parent"] and tags["parent_digest"] == recorded["digest"]
    assert tags["parent_corpus"] == lineage["base"] and tags["parent_run"] == "parent"
    assert logged["init_from"] == lineage["parent"] and logged["replay"] == "0.25"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"replay": 0.25}, "--replay continues a run: it needs --init-from"),
        ({"init_from": "nobody"}, "--init-from nobody: no run of that name"),
        (
            {"init_from": "PARENT", "preset": "small"},
            "is a tiny checkpoint .*: continue it with --preset tiny",
        ),
        ({"init_from": "PARENT", "replay": 0.05}, r"--replay 0\.05 of a batch of 8 rows rounds to no row"),
        (
            {"init_from": "PARENT", "warmup_steps": 10**6},
            r"--warmup-steps 1000000 is not shorter than the schedule's \d+ steps \(one pass over the new "
            r"data\): .* --warmup-share",
        ),
        ({"init_from": "PARENT", "warmup_steps": 4, "warmup_share": 0.1}, "--warmup-steps or --warmup-share"),
    ],
)
def test_a_continued_run_that_cannot_be_is_refused_before_any_process(
    lineage: dict[str, Any], home: Path, settings: dict[str, Any], message: str
) -> None:
    if settings.get("init_from") == "PARENT":
        settings = {**settings, "init_from": lineage["parent"]}
    with pytest.raises(ValueError, match=message):
        plan_job(PretrainParams(corpus=lineage["grown"], **{**SMALL, **settings}), get_settings())


@pytest.mark.slow
def test_a_continued_run_resumed_after_sigterm_equals_an_uninterrupted_one(
    lineage: dict[str, Any], home: Path
) -> None:
    store = home / "store"
    args = [
        "--corpus", lineage["grown"], "--init-from", lineage["parent"], "--replay", "0.25",
        "--store", str(store), *FAST, "--total-steps", "400", "--checkpoint-every", "100000",
        "--val-every", "100000", "--tracking", "off",
    ]  # fmt: skip
    launcher, handle = job([*args, "--run-name", "stopped"], home)
    deadline = time.monotonic() + 120
    while "progress step=10 " not in Path(handle.log_path).read_text():
        assert time.monotonic() < deadline and not launcher.status(handle).state.finished
        time.sleep(0.1)
    launcher.cancel(handle)
    latest = read_latest(LocalStore(store), "stopped")
    assert latest is not None and 10 <= latest["step"] < 400
    stop = ["--max-steps", str(latest["step"] + 6)]
    resumed = run_job([*args, "--run-name", "stopped", *stop], home, name="resumed")
    # The uninterrupted run in this process: the same job's code, one torchrun start fewer.
    config = TrainConfig.from_args([*args, "--run-name", "straight", *stop])
    with sigterm_kept():
        straight = fit(config, World(), get_settings(home=home))
    assert resumed["steps"] == straight.steps == latest["step"] + 6
    assert abs(resumed["final_loss"] - straight.final_loss) <= 1e-6
    assert straight.checkpoint_uri is not None
    a, b = (load_checkpoint(uri).state for uri in (straight.checkpoint_uri, resumed["checkpoint_uri"]))
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=0, atol=1e-6, msg=name)
    for key in ("h", "c"):
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)
