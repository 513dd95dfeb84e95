"""--sharding none|optimizer|full: the same losses as DDP, a share of Adam's state per rank, and
checkpoints that resume at another world size."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from train_helpers import job

from models.mlstm import MLSTM, preset
from tasks.jobs.checkpoint import (
    UntrustedCheckpoint,
    load_checkpoint,
    load_intact,
    save_sharded_checkpoint,
    save_shards,
    step_prefix,
)
from tasks.jobs.config import OptimizerSettings
from tasks.jobs.joblog import iter_progress
from tasks.jobs.sharding import optimizer_layout, save_sharded, wrap
from tasks.pipeline import apply_overrides, pretrain_key, validated
from tasks.pretrain.config import PretrainParams
from tasks.store import LocalStore, Store, open_store
from tasks.sweep.spec import parse_spec

FAST = [
    "--preset",
    "tiny",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--lr",
    "0.003",
    "--log-every",
    "1",
    "--tracking",
    "off",
]  # no test here reads an MLflow run


def run(args: list[str], home: Path, *, nproc: int, name: str) -> tuple[list[dict[str, float]], str]:
    """The job's progress lines (one a step) and its last checkpoint's URI."""
    launcher, handle = job(args, home, nproc=nproc, name=name)
    status = launcher.wait(handle, poll_seconds=0.2, timeout=300)
    log = Path(handle.log_path).read_text()
    assert status.exit_code == 0, log
    uri = log.rpartition("checkpoint step=")[2].split("uri=")[1].split()[0]
    return list(iter_progress(iter(log.splitlines()))), uri


@pytest.mark.slow
# optimizer is long: full shards Adam's state as optimizer does, and the weights and gradients too.
@pytest.mark.parametrize("sharding", [pytest.param("optimizer", marks=pytest.mark.long), "full"])
def test_a_sharding_trains_as_ddp_with_a_share_of_adams_state(
    sharding: str, sample_manifest: str, home: Path
) -> None:
    common = ["--corpus", sample_manifest, "--store", str(home / "store"), *FAST, "--max-steps", "20"]
    ddp, _ = run([*common, "--run-name", "ddp", "--sharding", "none"], home, nproc=2, name="ddp")
    sharded, _ = run([*common, "--run-name", sharding, "--sharding", sharding], home, nproc=2, name=sharding)
    assert len(sharded) == len(ddp) == 20
    for a, b in zip(ddp, sharded, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5), (a["step"], a["loss"], b["loss"])
    ratio = sharded[-1]["optimizer_bytes"] / ddp[-1]["optimizer_bytes"]
    assert 0.4 <= ratio <= 0.6, ratio


@pytest.mark.long  # about 70 s: three launches of two ranks
def test_a_sharded_checkpoint_resumes_at_another_world_size_and_sharding(
    sample_manifest: str, home: Path
) -> None:
    """full at 2 ranks (steps 0-8) → optimizer at 2 ranks (8-12) → one rank (12-16) equals a straight
    run; the sharded checkpoints are DCP files, consolidated into state.pt on first use and cached."""
    common = ["--corpus", sample_manifest, "--store", str(home / "store"), *FAST, "--checkpoint-every", "100"]
    straight, straight_uri = run(
        [*common, "--run-name", "straight", "--max-steps", "16"], home, nproc=1, name="a"
    )
    _, full_uri = run(
        [*common, "--run-name", "halves", "--max-steps", "8", "--sharding", "full"], home, nproc=2, name="b"
    )
    folder = Path(full_uri)
    assert json.loads((folder / "meta.json").read_text())["format"] == "dcp"
    assert sorted(p.name for p in (folder / "sharded").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (folder / "state.pt").exists()  # nothing gathered on rank 0 at save
    run(
        [*common, "--run-name", "halves", "--max-steps", "12", "--sharding", "optimizer"],
        home,
        nproc=2,
        name="c",
    )
    resumed, resumed_uri = run(
        [*common, "--run-name", "halves", "--max-steps", "16"], home, nproc=1, name="d"
    )
    assert [p["step"] for p in resumed] == [13, 14, 15, 16]
    assert resumed[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-5)
    a, b = load_checkpoint(straight_uri).state, load_checkpoint(resumed_uri).state
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert len(b["optimizer"]["state"]) == len(a["optimizer"]["state"])  # whole, not a shard
    # The transfer stage's reader: the step-8 DCP files as one state.pt, made once and cached.
    consolidated = load_checkpoint(full_uri)
    assert (folder / "state.pt").is_file() and (folder / "consolidated.json").is_file()
    assert consolidated.model().config.hidden_size == consolidated.model_config.hidden_size
    assert len(consolidated.state["optimizer"]["state"]) == len(a["optimizer"]["state"])
    assert consolidated.state["optimizer"]["param_groups"][0]["params"] == list(range(len(a["model"])))
    cached = load_checkpoint(full_uri).state
    for name, value in consolidated.state["model"].items():
        torch.testing.assert_close(cached["model"][name], value, rtol=0, atol=0, msg=name)


def _sharded_step(store: Store, step: int, scratch: Path) -> MLSTM:
    """A sharded checkpoint written as a job writes one (here by one process, one rank's files)."""
    torch.manual_seed(step)
    model = MLSTM(preset("tiny"))
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8)), model.zero_state(2))[0].sum().backward()
    adam.step()
    folder = scratch / str(step)
    folder.mkdir()
    save_sharded(model, adam, folder)
    files = save_shards(store, "r", step, folder)
    extra = {"schedule": {}, "scaler": {}, "h": torch.zeros(2, 4), "c": torch.zeros(2, 4)}
    meta = {"model": dataclasses.asdict(model.config)}
    save_sharded_checkpoint(store, "r", step, {**optimizer_layout(model, adam), **extra}, files, meta)
    return model


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_a_sharded_checkpoint_is_consolidated_on_first_use_and_its_damage_shows(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """In a folder store the DCP files are read in place; in S3 (moto on loopback) downloaded first."""
    if where == "s3":
        store = open_store(f"s3://{request.getfixturevalue('s3_bucket')}/store")
    else:
        store = LocalStore(tmp_path / "store")
    _sharded_step(store, 4, tmp_path)
    model = _sharded_step(store, 8, tmp_path)
    prefix = step_prefix("r", 8)
    consolidated = load_checkpoint(store.url(prefix))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(consolidated.state["model"][name], value, rtol=0, atol=0)
    assert sorted(consolidated.state["optimizer"]["state"]) == list(range(len(list(model.parameters()))))
    assert store.exists(f"{prefix}/state.pt") and store.exists(f"{prefix}/consolidated.json")  # cached
    # A resume reads the DCP files; one cut short is damage, named, and the step before answers.
    shard = f"{prefix}/sharded/__0_0.distcp"
    store.write_bytes(shard, store.read_bytes(shard)[:100])
    found = load_intact(store, "r", shards_to=tmp_path / "resume")
    assert found is not None and found[0].step == 4 and found[0].sharded is not None
    assert "sharded/__0_0.distcp is damaged" in found[1][0]


class _Payload:
    """A pickle that, unpickled, writes a file: what a forged DCP ``.metadata`` can run."""

    def __init__(self, proof: Path) -> None:
        self.proof = proof

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (self.proof.write_text, ("ran",))


@pytest.mark.parametrize("key", ["MLSTM_CHECKPOINT_KEY", "none set"])
def test_a_forged_dcp_metadata_is_never_unpickled(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's ``.metadata`` is a pickle: one put in the store with its digest rewritten into ``meta.json``
    is refused by every reader before it is opened, under a team's key or, with none set, the key made
    under MLSTM_HOME; the intact step loads, and a cached consolidation without the key's HMAC is made
    again."""
    monkeypatch.setenv("MLSTM_HOME", str(tmp_path / "home"))
    if key == "MLSTM_CHECKPOINT_KEY":
        monkeypatch.setenv("MLSTM_CHECKPOINT_KEY", "a key of the pipeline's own")
    else:
        monkeypatch.delenv("MLSTM_CHECKPOINT_KEY")
    store = LocalStore(tmp_path / "store")
    model = _sharded_step(store, 4, tmp_path)
    _sharded_step(store, 8, tmp_path)
    intact = load_checkpoint(store.url(step_prefix("r", 4)))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(intact.state["model"][name], value, rtol=0, atol=0)

    folder = tmp_path / "store" / step_prefix("r", 8)
    proof = tmp_path / "proof"
    metadata = folder / "sharded" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(proof)))
    meta = json.loads((folder / "meta.json").read_text())
    meta["sha256"]["sharded/.metadata"] = hashlib.sha256(metadata.read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UntrustedCheckpoint, match=r"step-0000008/meta.json does not match its HMAC"):
        load_checkpoint(store.url(step_prefix("r", 8)))  # a consolidation
    found = load_intact(store, "r", shards_to=tmp_path / "resume")  # a resume
    assert found is not None and found[0].step == 4 and "meta.json does not match" in found[1][0]
    assert not proof.exists()

    # The step-4 cache, replaced with other weights and their digest: not read, made again.
    cache = tmp_path / "store" / step_prefix("r", 4)
    torch.save(
        {**intact.state, "model": {k: v + 1 for k, v in intact.state["model"].items()}}, cache / "state.pt"
    )
    digest = hashlib.sha256((cache / "state.pt").read_bytes()).hexdigest()
    signed = json.loads((cache / "consolidated.json").read_text())
    (cache / "consolidated.json").write_text(json.dumps({**signed, "sha256": digest}))
    again = load_checkpoint(store.url(step_prefix("r", 4)))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(again.state["model"][name], value, rtol=0, atol=0)


def test_the_sharding_is_a_setting_of_the_launch_not_of_the_run() -> None:
    """The pipeline finds (and resumes) the same run whatever --sharding a relaunch gives."""
    params = PretrainParams(corpus="c")
    key = pretrain_key(params, "corpus-id")
    assert pretrain_key(params.model_copy(update={"sharding": "full"}), "corpus-id") == key
    assert pretrain_key(params.model_copy(update={"lr": 1e-3}), "corpus-id") != key


def test_the_sharding_reaches_the_pipeline_and_the_sweep() -> None:
    """``--set pretrain.sharding=…`` and a sweep spec's fixed ``sharding`` reach the launch."""
    base = validated({"sources": ["raw/"], "transfer": {"datasets": [f"sst2={Path(__file__).parent}"]}})
    changed = validated(apply_overrides(base.model_dump(mode="json"), ["pretrain.sharding=full"]))
    assert changed.pretrain.sharding == "full"
    with pytest.raises(
        ValueError, match=r"pretrain\.sharding: Input should be 'none', 'optimizer' or 'full'"
    ):
        validated(apply_overrides(base.model_dump(mode="json"), ["pretrain.sharding=zero3"]))
    spec = parse_spec(
        {
            "corpus": "/c/manifest.json",
            "preset": "tiny",
            "sharding": "optimizer",
            "budget": {"trials": 2, "max_steps": 20},
            "asha": {"min_steps": 10, "eta": 2},
            "space": {"lr": {"log_uniform": [1e-4, 1e-2]}},
        }
    )
    assert spec.trial_params({"lr": 1e-3}, "r", 10).sharding == "optimizer"


def test_full_sharding_refuses_fp16_with_what_to_use() -> None:
    with pytest.raises(ValueError, match="--precision bf16 or fp32"):
        wrap(
            torch.nn.Linear(2, 2),
            "full",
            world_size=2,
            device=torch.device("cpu"),
            dtype=torch.float16,
            optimizer=OptimizerSettings(),
            lr=1e-3,
        )
