"""Damaged checkpoints (issue 19): each ``state.pt`` carries its sha256 in ``meta.json``; a damaged newest
one falls back to the newest intact one with one warning naming it; none intact is one error naming them,
and the launcher does not relaunch a job that reported an error no relaunch can mend."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_in_process
from train_helpers import run_job

from tasks.jobs.checkpoint import (
    DamagedCheckpoint,
    UntrustedCheckpoint,
    load_checkpoint,
    load_intact,
    save_checkpoint,
    step_prefix,
)
from tasks.store import LocalStore

CLI = str(Path(sys.executable).parent / "mlstm-sentiment")
FAST = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--lr", "0.003", "--log-every", "4"]


def _truncate(path: Path) -> None:
    """Cut a file short, as a full disk or a killed copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _save_steps(store: LocalStore, run: str, steps: list[int]) -> None:
    for step in steps:
        save_checkpoint(store, run, step, {"w": torch.full((64,), float(step))}, {"note": "unit"})


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _save_steps(store, "r", [10, 20, 30])
    meta = json.loads(store.read_bytes(f"{step_prefix('r', 30)}/meta.json"))
    assert len(meta["sha256"]["state.pt"]) == 64
    _truncate(tmp_path / step_prefix("r", 30) / "state.pt")
    found = load_intact(store, "r")
    assert found is not None
    saved, damaged = found
    assert saved.step == 20 and float(saved.state["w"][0]) == 20.0
    assert len(damaged) == 1 and f"{step_prefix('r', 30)}/state.pt is damaged" in damaged[0]
    # A run folder's URI (what transfer and `features` take) answers with the intact step too.
    assert load_checkpoint(str(tmp_path / "runs" / "r")).step == 20


def test_a_deleted_newest_state_and_a_corrupt_latest_fall_back_by_name(tmp_path: Path) -> None:
    """A newest ``state.pt`` gone (a cleanup, a half-copied folder) is damage like a cut one; a
    ``latest.json`` that is not JSON is named, and the steps' own folders say where to resume."""
    store = LocalStore(tmp_path)
    _save_steps(store, "r", [10, 20, 30])
    (tmp_path / step_prefix("r", 30) / "state.pt").unlink()
    found = load_intact(store, "r")
    assert found is not None and found[0].step == 20
    assert len(found[1]) == 1 and f"{step_prefix('r', 30)}" in found[1][0]

    (tmp_path / "runs" / "r" / "latest.json").write_text('{"step": 3\x00')
    found = load_intact(store, "r")
    assert found is not None and found[0].step == 20
    assert "runs/r/latest.json is damaged: not a JSON object" in found[1][0]


def test_a_flipped_byte_is_damage_too_and_the_step_uri_names_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _save_steps(store, "r", [10])
    path = tmp_path / step_prefix("r", 10) / "state.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # same length, loads or not: only the digest can tell
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=r"step-0000010/state.pt is damaged.*sha256"):
        load_checkpoint(str(tmp_path / step_prefix("r", 10)))


def test_none_intact_names_every_damaged_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _save_steps(store, "r", [10, 20])
    for step in (10, 20):
        _truncate(tmp_path / step_prefix("r", step) / "state.pt")
    with pytest.raises(DamagedCheckpoint) as raised:
        load_intact(store, "r")
    message = str(raised.value)
    assert "run r has no intact checkpoint" in message
    assert "step-0000010/state.pt is damaged" in message and "step-0000020/state.pt is damaged" in message


def _unsign(folder: Path, *, digests: bool = True) -> None:
    """``meta.json`` as a checkpoint saved before signing was on by default had it (and, older still,
    without its files' digests)."""
    meta = json.loads((folder / "meta.json").read_text())
    del meta["hmac_sha256"]
    if not digests:
        del meta["sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))


def test_an_old_checkpoint_is_refused_naming_the_command_that_signs_it(tmp_path: Path) -> None:
    """One saved before signing (with or without digests) is refused in one line naming `checkpoints
    sign`; signed, it loads, and damage after that still shows; a file damaged before is not signed."""
    store = LocalStore(tmp_path)
    _save_steps(store, "r", [10, 20])
    for step in (10, 20):
        _unsign(tmp_path / step_prefix("r", step), digests=step == 20)
    folder = tmp_path / step_prefix("r", 10)
    with pytest.raises(UntrustedCheckpoint) as raised:
        load_checkpoint(str(folder))
    assert str(raised.value) == (
        f"{folder}/meta.json is not signed: not read (saved before signing was on by default, or not by "
        f"the pipeline): check it, then sign it with `mlstm-sentiment checkpoints sign {folder}`"
    )
    done = cli_in_process(["checkpoints", "sign", "r", "--store", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["signed", str(tmp_path / step_prefix("r", 20)), "signed", str(folder)]
    assert load_checkpoint(str(tmp_path / "runs" / "r")).step == 20
    assert float(load_checkpoint(str(folder)).state["w"][0]) == 10.0
    _truncate(tmp_path / step_prefix("r", 20) / "state.pt")
    found = load_intact(store, "r")
    assert found is not None and found[0].step == 10
    assert "step-0000020/state.pt is damaged" in found[1][0]

    _unsign(folder)  # its digest recorded: a file that no longer matches it is not signed
    _truncate(folder / "state.pt")
    done = cli_in_process(["checkpoints", "sign", str(folder)])
    assert done.returncode == 2 and "not signed" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    with pytest.raises(UntrustedCheckpoint, match="is not signed"):
        load_checkpoint(str(folder))


def _forge(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """What someone who can write the store does: a state.pt of theirs, and meta.json given its sha256."""
    torch.save(state, folder / "state.pt")
    meta = json.loads((folder / "meta.json").read_text())
    meta["sha256"]["state.pt"] = hashlib.sha256((folder / "state.pt").read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))


def test_a_rewritten_checkpoint_or_one_under_another_key_is_refused_naming_its_meta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path)
    monkeypatch.setenv("MLSTM_CHECKPOINT_KEY", "a key of the pipeline's own")
    _save_steps(store, "r", [10, 20])
    assert float(load_checkpoint(str(tmp_path / step_prefix("r", 20))).state["w"][0]) == 20.0

    folder = tmp_path / step_prefix("r", 20)
    _forge(folder, {"w": torch.full((64,), 666.0)})
    with pytest.raises(UntrustedCheckpoint) as raised:
        load_checkpoint(str(folder))
    assert str(raised.value) == (
        f"{folder}/meta.json does not match its HMAC under MLSTM_CHECKPOINT_KEY: not read (changed since it "
        "was saved, or saved with another key: set MLSTM_CHECKPOINT_KEY to the key it was saved with)"
    )
    # A resume (and a run folder's URI) steps over it to the newest checkpoint the key signs.
    found = load_intact(store, "r")
    assert (
        found is not None and found[0].step == 10 and "step-0000020/meta.json does not match" in found[1][0]
    )
    monkeypatch.setenv("MLSTM_CHECKPOINT_KEY", "another key")
    with pytest.raises(UntrustedCheckpoint, match="does not match its HMAC"):
        load_checkpoint(str(tmp_path / step_prefix("r", 10)))


def test_with_no_key_set_a_key_made_under_the_home_signs_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No MLSTM_CHECKPOINT_KEY: a key made on first use in $MLSTM_HOME/keys/checkpoint.key, readable by
    its owner only, signs and checks; a forged checkpoint is refused; with the key file changed or
    removed (a new one is made), the checkpoints it signed are refused naming the file and the setting."""
    from tasks.signing import key_file

    monkeypatch.delenv("MLSTM_CHECKPOINT_KEY")
    home = tmp_path / "home"
    monkeypatch.setenv("MLSTM_HOME", str(home))
    store = LocalStore(tmp_path / "store")
    _save_steps(store, "r", [10, 20])
    path = key_file(home)
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text().strip()) == 64
    assert float(load_checkpoint(str(tmp_path / "store" / "runs" / "r")).state["w"][0]) == 20.0

    folder = tmp_path / "store" / step_prefix("r", 20)
    _forge(folder, {"w": torch.full((64,), 666.0)})
    with pytest.raises(UntrustedCheckpoint, match=r"step-0000020/meta\.json does not match its HMAC"):
        load_checkpoint(str(folder))

    signed_with_another = (
        f"{tmp_path / 'store' / step_prefix('r', 10)}/meta.json does not match its HMAC under the key in "
        f"{path} (MLSTM_CHECKPOINT_KEY unset): not read (changed since it was saved, or saved with another "
        "key: set MLSTM_CHECKPOINT_KEY to the key it was saved with)"
    )
    original = path.read_text()
    path.write_text("0" * 64)
    with pytest.raises(UntrustedCheckpoint) as raised:
        load_checkpoint(str(tmp_path / "store" / step_prefix("r", 10)))
    assert str(raised.value) == signed_with_another
    path.unlink()
    with pytest.raises(UntrustedCheckpoint) as raised:
        load_checkpoint(str(tmp_path / "store" / step_prefix("r", 10)))
    assert str(raised.value) == signed_with_another
    assert path.read_text() not in (original, "0" * 64)  # a new key, made as the first one was
    monkeypatch.setenv("MLSTM_CHECKPOINT_KEY", original.strip())  # the key it was saved with
    assert load_checkpoint(str(tmp_path / "store" / step_prefix("r", 10))).step == 10


def test_racing_processes_make_one_key(tmp_path: Path) -> None:
    """Processes of a new home asking for the key at once all get the one key left in the file."""
    from tasks.signing import key_file

    script = (
        "import sys; from pathlib import Path; from tasks.signing import home_key; "
        "sys.stdout.write(home_key(Path(sys.argv[1])).decode())"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLSTM_CHECKPOINT_KEY"}
    started = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(6)
    ]
    keys = {process.communicate(timeout=60)[0] for process in started}
    assert keys == {key_file(tmp_path).read_text().strip()}
    assert [p.name for p in key_file(tmp_path).parent.iterdir()] == ["checkpoint.key"]  # no scratch left


@pytest.mark.slow
def test_a_real_run_resumes_from_the_previous_step_when_the_newest_is_cut_short(
    sample_manifest: str, home: Path
) -> None:
    store = home / "store"
    args = ["--corpus", sample_manifest, "--store", str(store), *FAST, "--run-name", "cut"]
    args += ["--checkpoint-every", "4", "--val-every", "100", "--tracking", "off"]
    first = run_job([*args, "--max-steps", "8"], home, name="cut")
    assert first["steps"] == 8
    newest = store / step_prefix("cut", 8) / "state.pt"
    _truncate(newest)
    again = run_job([*args, "--max-steps", "12"], home, name="cut-again")
    assert again["steps"] == 12
    log = (home / "jobs" / "cut-again.log").read_text()
    warnings = [line for line in log.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, log
    assert f"{newest} is damaged" in warnings[0] and "resuming from step 4" in warnings[0]
    assert "resumed run cut from step 4 " in log


@pytest.mark.long  # about 95 s; test_none_intact_names_every_damaged_file keeps the rule in make test
def test_all_damaged_is_one_error_naming_them_and_no_relaunch(
    sample_manifest: str, home: Path, prefect_api_url: str
) -> None:
    store = home / "store"
    common = ["--corpus", sample_manifest, *FAST[:-2], "--checkpoint-every", "4", "--val-every", "100"]
    run_job(["--store", str(store), *common, "--run-name", "ruined", "--max-steps", "8"], home, name="ruined")
    for step in (4, 8):
        _truncate(store / step_prefix("ruined", step) / "state.pt")
    env = {**os.environ, "MLSTM_HOME": str(home), "PREFECT_API_URL": prefect_api_url}
    done = subprocess.run(
        [CLI, "pretrain", *common, "--run", "ruined", "--max-steps", "12", "--retries", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    stderr = " ".join(done.stderr.split())
    assert "run ruined has no intact checkpoint" in stderr, done.stderr
    for step in (4, 8):
        assert f"{store / step_prefix('ruined', step)}/state.pt is damaged" in stderr, done.stderr
    assert "Traceback" not in done.stderr
    log = (home / "jobs" / "ruined.log").read_text()
    launches = [line for line in log.splitlines() if line.startswith("$ ")]
    assert len(launches) == 2, log  # the run_job above and one CLI launch: no relaunch
