"""The pretraining job: the loss goes down, DDP and resuming change nothing, SIGTERM checkpoints,
a crashed rank becomes a resuming retry, and bad settings fail before any process starts."""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import cli_in_process
from processes import listening_tcp
from torch.nn import functional as F
from train_helpers import job, run_job

from models.mlstm import MLSTM, preset
from tasks.jobs.checkpoint import load_checkpoint, read_latest
from tasks.jobs.world import World
from tasks.pretrain.config import TrainConfig
from tasks.pretrain.graphed import GraphedStep
from tasks.pretrain.metrics import peak_flops
from tasks.pretrain.stream import BatchPlan, ByteStream, open_split
from tasks.pretrain.train import Trainer, bits_per_byte, fit, lr_factor
from tasks.settings import get_settings
from tasks.store import LocalStore

CLI = str(Path(sys.executable).parent / "mlstm-sentiment")
# Small enough for two CPU cores: 8 rows of 32 bytes a step.
FAST = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--lr", "0.003", "--log-every", "5"]


def test_schedule_warms_up_then_decays_linearly_to_zero() -> None:
    factors = [lr_factor(step, warmup_steps=4, total_steps=20) for step in range(21)]
    assert factors[:4] == pytest.approx([0.25, 0.5 * 19 / 20, 0.75 * 18 / 20, 17 / 20])
    assert factors[10] == pytest.approx(0.5) and factors[20] == 0.0
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))


def test_job_flags_round_trip_and_scale_the_learning_rate() -> None:
    config = TrainConfig(
        corpus="s3://b/c/manifest.json", preset="small", run_name="r", batch_size=512, lr_scaling="sqrt"
    )
    assert TrainConfig.from_args(config.to_args()) == config
    assert config.effective_lr() == pytest.approx(5e-4 * 2)  # sqrt(512 / 128)
    with pytest.raises(ValueError, match="unknown preset 'huge': choose one of tiny, small"):
        TrainConfig(corpus="c", preset="huge", run_name="r")


# What the model must beat the unigram entropy by: a quarter of a bit, several times the spread of a
# 256-byte batch's mean loss, and well above what a model without input can reach (none).
LOSS_MARGIN_BITS = 0.25


def _unigram_bits(stream: ByteStream) -> float:
    """Entropy in bits of the stream's byte frequencies: the best a model without input can score."""
    counts = np.bincount(stream.read(0, len(stream)), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


@pytest.mark.long
def test_loss_goes_down_on_the_amazon_corpus(amazon_manifest: str, home: Path) -> None:
    store = home / "store"
    args = ["--corpus", amazon_manifest, "--store", str(store), "--run-name", "down", *FAST]
    result = run_job([*args, "--max-steps", "150", "--val-every", "50", "--val-steps", "8"], home)
    assert result["steps"] == 150 and result["preempted"] is False
    # A model that ignores its input can still learn the byte frequencies: it scores the val text's
    # unigram entropy (4.50 bits here), which a fixed bound such as < 4.5 bits lets through. The
    # model must beat that by LOSS_MARGIN_BITS, on val and on its last training batch (the splits are
    # a hash of the same reviews, so they share the frequencies).
    unigram = _unigram_bits(open_split(amazon_manifest, "val", home / "cache"))
    assert result["val_bpc"] < unigram - LOSS_MARGIN_BITS, (result["val_bpc"], unigram)
    assert result["final_loss"] / math.log(2) < unigram - LOSS_MARGIN_BITS, (result["final_loss"], unigram)

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    run = mlflow.get_run(result["run_id"])
    assert run.data.params["preset"] == "tiny" and run.data.tags["stage"] == "pretrain"
    assert run.data.tags["checkpoint_uri"] == result["checkpoint_uri"]
    assert run.data.tags["manifest_uri"] == amazon_manifest
    losses = [m.value for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0
    assert {"bpc", "val_bpc", "lr", "chars_per_s", "loss_scale"} <= set(run.data.metrics)
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)]
    assert "loss_curve.png" in artifacts


def _bits_per_byte(model: MLSTM, stream: ByteStream, plan: BatchPlan, steps: int) -> float:
    """Next-byte cross-entropy in bits, read as validation reads: from a zero state, carried over steps."""
    nats, count = 0.0, 0
    state = model.zero_state(len(plan.rows))
    with torch.no_grad():
        for step in range(steps):
            rows = torch.from_numpy(plan.batch(stream, step).astype(np.int64))
            logits, state, _ = model(rows[:, :-1], state)
            nats += F.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1), reduction="sum").item()
            count += rows[:, 1:].numel()
    return nats / count / math.log(2)


def test_bits_per_byte_counts_every_byte_of_a_stream_in_memory() -> None:
    """A model whose every logit is equal pays 8 bits a byte; one that gives the stream's only byte a
    probability of 1/2 pays 1 bit, over the whole stream whatever its rows and length."""
    model = MLSTM(preset("tiny"))
    with torch.no_grad():
        model.out.weight.zero_()
        model.out.bias.zero_()
    stream = ByteStream.of(np.full(10_007, ord("a"), dtype=np.uint8))
    assert bits_per_byte(model, stream, rows=8, seq_len=32) == pytest.approx(8.0, rel=1e-6)  # float32 logits
    with torch.no_grad():  # logit of "a" log(255) above the rest: p = 255 / (255 + 255) = 1/2
        model.out.bias[ord("a")] = math.log(255)
    assert bits_per_byte(model, stream, rows=3, seq_len=50) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.slow
def test_val_bpc_is_what_the_saved_weights_score_on_the_val_rows(sample_manifest: str, home: Path) -> None:
    """The logged val_bpc, recomputed here from the checkpoint on the same val rows, in bits."""
    config = TrainConfig(
        corpus=sample_manifest, preset="tiny", run_name="honest", store=str(home / "store"),
        batch_size=8, seq_len=32, lr=0.003, max_steps=10, val_every=10, val_steps=4, log_every=5,
    )  # fmt: skip
    handler = signal.getsignal(signal.SIGTERM)
    try:
        result = fit(config, World(), get_settings(home=home))
    finally:
        signal.signal(signal.SIGTERM, handler)  # fit's preemption handler is the job's, not pytest's
    saved = load_checkpoint(result.checkpoint_uri)
    model = MLSTM(preset(saved.meta["preset"]))
    model.load_state_dict(saved.state["model"])
    val = open_split(sample_manifest, "val", home / "cache")
    plan = BatchPlan(len(val), min(config.batch_size, len(val) // (config.seq_len + 1)), config.seq_len)
    bits = _bits_per_byte(model, val, plan, min(config.val_steps, plan.steps_per_epoch))
    assert result.val_bpc == pytest.approx(bits, rel=1e-5)

    import mlflow

    logged = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(result.run_id).data.metrics
    assert logged["val_bpc"] == pytest.approx(bits, rel=1e-5)


def test_the_mfu_peak_is_the_measured_one_when_known(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("MLSTM_PEAK_FLOPS", "2.5e12")
    assert peak_flops(cpu, torch.float32, tmp_path) == 2.5e12
    monkeypatch.delenv("MLSTM_PEAK_FLOPS")
    assert peak_flops(cpu, torch.float32, tmp_path) is None  # a CPU has no datasheet peak here


def test_a_captured_step_refuses_an_optimizer_it_cannot_capture() -> None:
    model = MLSTM(preset("tiny"))
    bytes_BT = torch.zeros(2, 5, dtype=torch.long)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for optimizer, message in (
        (torch.optim.Adam(model.parameters(), lr=1e-3), "lr as a device tensor"),
        (torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3)), "capturable=True"),
    ):
        with pytest.raises(ValueError, match=message):
            GraphedStep(
                model,
                optimizer,
                scaler,
                model.zero_state(2),
                bytes_BT,
                bytes_BT,
                dtype=torch.float32,
                clip=1.0,
            )


@pytest.mark.slow  # the Amazon corpus built, then 40 steps, half of them on the byte-by-byte cell
def test_the_fused_recurrence_trains_as_the_reference_cell_does(amazon_manifest: str, home: Path) -> None:
    losses = {}
    for recurrence in ("fused", "reference"):
        config = TrainConfig(
            corpus=amazon_manifest,
            preset="tiny",
            run_name=recurrence,
            store=str(home / "store"),
            batch_size=8,
            seq_len=32,
            lr=0.003,
            precision="fp32",
            recurrence=recurrence,
        )
        trainer = Trainer(config, World(), get_settings(home=home))
        assert trainer.model.recurrence == recurrence
        losses[recurrence] = [trainer.train_step().item() for _ in range(20)]
    assert losses["fused"][-1] < losses["fused"][0] - 0.5  # it learns, so the steps are not all alike
    for step, (fused, reference) in enumerate(zip(losses["fused"], losses["reference"], strict=True)):
        assert abs(fused - reference) <= 1e-6, f"step {step}: fused {fused}, reference {reference}"


# Rank 0 of a job whose test reads no MLflow run leaves MLflow out (about 8 s of CPU a launch: the import,
# the database, the loss plot); the tests of tracking keep it.
UNTRACKED = ["--tracking", "off"]


@pytest.mark.slow
def test_two_ranks_equal_one_rank_and_a_resumed_run_the_uninterrupted_one(
    sample_manifest: str, home: Path
) -> None:
    """One rank and two with the same global batch train the same weights; two ranks stopped at step 8
    and launched again reproduce the uninterrupted run exactly (weights, carried state, loss) in the same
    MLflow run, the partial checkpoint file of a killed write removed."""
    common = ["--corpus", sample_manifest, "--store", str(home / "store"), *FAST, "--checkpoint-every", "100"]
    whole = [*common, "--max-steps", "16"]
    # One rank in this process: the job's own code, one torchrun start fewer.
    handler = signal.getsignal(signal.SIGTERM)
    try:
        one = fit(
            TrainConfig.from_args([*whole, "--run-name", "one", *UNTRACKED]), World(), get_settings(home=home)
        )
    finally:
        signal.signal(signal.SIGTERM, handler)  # fit's preemption handler is the job's, not pytest's
    straight = run_job([*whole, "--run-name", "straight", *UNTRACKED], home, nproc=2, name="straight")
    assert straight["final_loss"] == pytest.approx(one.final_loss, rel=1e-5)
    assert one.checkpoint_uri is not None
    weights_one = load_checkpoint(one.checkpoint_uri).state["model"]
    weights_two = load_checkpoint(straight["checkpoint_uri"]).state["model"]
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    half = run_job([*common, "--run-name", "halves", "--max-steps", "8"], home, nproc=2)
    assert half["steps"] == 8
    # What a launch killed while writing a checkpoint leaves: its next launch removes it.
    (partial := Path(half["checkpoint_uri"]) / ".tmp-0a1b-state.pt").write_bytes(b"")
    resumed = run_job([*common, "--run-name", "halves", "--max-steps", "16"], home, nproc=2)
    assert resumed["steps"] == 16 and resumed["run_id"] == half["run_id"] is not None
    assert not partial.exists()
    assert abs(resumed["final_loss"] - straight["final_loss"]) <= 1e-6
    a = load_checkpoint(straight["checkpoint_uri"]).state
    b = load_checkpoint(resumed["checkpoint_uri"]).state
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(b["h"], a["h"], rtol=0, atol=1e-6)  # the carried state too


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_local_job_listens_on_loopback_and_sigterm_checkpoints_where_a_relaunch_resumes(
    sample_manifest: str, home: Path
) -> None:
    """A 2-rank local job: no socket of it (torchrun's agent, the ranks' store, gloo) is reachable from
    another machine, each listening one bound to a loopback address; SIGTERM to torchrun (a scheduler's
    preemption) checkpoints at the step it reached, leaves no process and removes the rendezvous file,
    and the next launch resumes there."""
    store = home / "store"
    args = ["--corpus", sample_manifest, "--store", str(store), *FAST, "--run-name", "preempted", *UNTRACKED]
    launcher, handle = job([*args, "--checkpoint-every", "100000", "--val-every", "100000"], home, nproc=2)
    try:
        _wait_for_step(5, launcher, handle)  # the process group is up
        listening = listening_tcp(int(handle.job_id))
        rendezvous = list((home / "jobs").glob("*.rendezvous"))
        _wait_for_step(20, launcher, handle)
    finally:
        launcher.cancel(handle)  # SIGTERM to torchrun, which passes it to the ranks
    # rank 0's store and each rank's gloo listener at least: the listing sees the job's sockets
    assert len(listening) >= 3, listening
    off_loopback = [(pid, address) for pid, address in listening if not _on_loopback(address)]
    assert not off_loopback, f"listening off loopback: {off_loopback} (all: {listening})"
    assert len(rendezvous) == 1  # torchrun's rendezvous is a file, removed when the job ends
    launcher.status(handle)
    assert not rendezvous[0].exists()

    log = Path(handle.log_path).read_text()
    latest = read_latest(LocalStore(store), "preempted")
    assert latest is not None, log
    assert 20 <= latest["step"] < latest["total_steps"]  # a checkpoint that no schedule asked for
    assert f"SIGTERM: checkpointed at step {latest['step']}" in log
    assert not _processes_matching("--run-name preempted")

    result = run_job([*args, "--max-steps", str(latest["step"] + 5)], home, nproc=2, name="again")
    assert result["steps"] == latest["step"] + 5


def _wait_for_step(step: int, launcher: Any, handle: Any) -> None:
    deadline = time.monotonic() + 120
    while f"progress step={step} " not in Path(handle.log_path).read_text():
        assert time.monotonic() < deadline and not launcher.status(handle).state.finished
        time.sleep(0.1)


def _on_loopback(address_port: str) -> bool:
    address = ipaddress.ip_address(address_port.rpartition(":")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _processes_matching(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", "--", marker], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


@pytest.fixture
def cli_env(prefect_api_url: str, home: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": prefect_api_url, "MLSTM_HOME": str(home)}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-size", "7", "--nproc", "2"], "batch size 7 is not divisible by 2 ranks"),
        (["--preset", "huge"], "unknown preset 'huge': choose one of tiny, small, paper_4096, paper_8192"),
        (["--corpus", "/nowhere/manifest.json"], "--corpus /nowhere/manifest.json: no corpus manifest there"),
        (["--batch-size", "4096", "--seq-len", "256"], "use a smaller batch or sequence length"),
        (["--nodes", "2"], "--nodes 2 needs --launcher slurm or kubernetes"),
    ],
)
def test_bad_settings_fail_before_any_process_starts(
    flags: list[str], message: str, sample_manifest: str, home: Path
) -> None:
    env: dict[str, str | None] = {"MLSTM_HOME": str(home), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    done = cli_in_process(["pretrain", "--corpus", sample_manifest, *flags], env)
    assert done.returncode == 2, done.stderr
    assert message in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr
    assert not (home / "jobs").exists()  # no job was started, and no Prefect API was needed to say so


@pytest.mark.slow
def test_a_diverged_run_stops_in_one_line_naming_the_step_and_is_not_relaunched(
    prefect_api_url: str, sample_manifest: str, home: Path
) -> None:
    """A learning rate that blows the weights up: the job stops at the first logged loss that is not finite
    or far above a uniform guess's, with one line naming the step and the job log; it writes no checkpoint
    of the broken weights, and the flow does not relaunch it. The command runs in this process (the job
    under torchrun is a process of its own): its answer is the rule, not its interpreter."""
    args = ["pretrain", "--corpus", sample_manifest, *FAST[:-4], "--lr", "1e30", "--log-every", "1"]
    args += ["--run", "diverged", "--max-steps", "30", "--retries", "2", "--json"]
    done = cli_in_process(args, {"PREFECT_API_URL": prefect_api_url, "MLSTM_HOME": str(home)})
    assert done.returncode == 2, done.stderr
    line = done.stderr.splitlines()[-1]  # the command's own answer, after Prefect's log of the failed run
    assert line.startswith("error: job ") and "Traceback" not in done.stderr, done.stderr
    assert "stopping local job" not in done.stderr  # it had ended: nothing to stop
    assert re.search(r"the loss is \S+ nats at step \d+: training diverged", line), line
    assert "lower --lr (now 1e+30)" in line, line
    assert f"log: {home / 'jobs' / 'diverged.log'}" in line, line
    assert done.stdout == ""
    log = (home / "jobs" / "diverged.log").read_text()
    assert log.count("run diverged: tiny") == 1  # one launch: the flow did not retry it
    assert "checkpoint step=" not in log


@pytest.mark.parametrize(
    ("raised", "said", "code"),
    [
        (
            FileNotFoundError(2, "No such file or directory", "/store/shard.arrow"),
            "error: rank 0: FileNotFoundError",
            2,
        ),
        (
            ConnectionError("peer reset\nby the network"),
            "failed: rank 0: ConnectionError: peer reset by the network",
            None,
        ),
    ],
)
def test_a_rank_says_its_last_exception_in_one_line_and_whether_a_relaunch_may_mend_it(
    raised: Exception,
    said: str,
    code: int | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A file that is missing stays missing: an ``error:`` line, exit 2, which the watcher fails unretried.
    Anything else may be transient: a ``failed:`` line the watcher's error quotes, and the exception goes on."""
    import tasks.pretrain.train as train
    from tasks.jobs import joblog

    def fit(*args: object) -> None:
        raise raised

    monkeypatch.setattr(train, "fit", fit)
    argv = ["--corpus", "c/manifest.json", "--run-name", "r"]
    if code is None:
        with pytest.raises(type(raised)):
            train.main(argv)
    else:
        assert train.main(argv) == code
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith(said), lines
    assert (joblog.errors_in(lines) != []) == (code == 2) and (joblog.failures_in(lines) != []) == (
        code is None
    )


def test_the_watchers_error_quotes_the_ranks_last_words_and_names_the_log() -> None:
    from tasks.jobs.launchers.base import (
        JobError,
        JobFailed,
        JobHandle,
        JobSpec,
        JobState,
        JobStatus,
        Launcher,
    )
    from tasks.jobs.watch import watch

    class Ended(Launcher):
        """A job that has ended, failed, with this log."""

        name = "ended"

        def __init__(self, text: str) -> None:
            self.text = text

        def submit(self, spec: JobSpec) -> JobHandle:
            raise NotImplementedError

        def status(self, handle: JobHandle) -> JobStatus:
            return JobStatus(JobState.FAILED, 1, "torchrun exited with 1")

        def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
            return self.text[offset:], len(self.text)

        def cancel(self, handle: JobHandle) -> None:
            pass

    handle = JobHandle("ended", "7", "/home/jobs/r.log")
    log = "progress step=1 of=10 loss=5\nfailed: rank 1: ConnectionError: peer reset\n"
    with pytest.raises(JobFailed) as raised:
        watch(Ended(log), handle, on_line=lambda _: None, on_progress=lambda _: None, poll_seconds=0)
    assert str(raised.value) == (
        "job 7 failed: torchrun exited with 1; rank 1: ConnectionError: peer reset (log: /home/jobs/r.log)"
    )
    assert not isinstance(raised.value, JobError)  # may be transient: relaunched


def _pretrain_cli(run: str, manifest: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """``mlstm-sentiment pretrain`` on 2 CPU ranks for 200 steps, checkpointing every 20."""
    args = ["pretrain", "--corpus", manifest, *FAST[:-2], "--nproc", "2", "--run", run, "--max-steps", "200"]
    # Two relaunches: one for the crash, one for the rare gloo teardown abort after the last step
    # (tasks/pretrain/train.py main: "terminate called without an active exception"), which resumes at the end.
    args += ["--checkpoint-every", "20", "--val-every", "100", "--retries", "2", "--json"]
    return subprocess.Popen([CLI, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _resumed_steps(log: Path, run: str) -> list[int]:
    """The step each relaunch of a run resumed from, in order."""
    marker = f"resumed run {run} from step "
    return [
        int(line.removeprefix(marker).split()[0])
        for line in log.read_text().splitlines()
        if line.startswith(marker)
    ]


@pytest.mark.long
def test_the_flow_retries_a_crashed_job_from_latest(
    cli_env: dict[str, str], sample_manifest: str, home: Path
) -> None:
    """A rank is killed mid-run: torchrun fails the job, the flow relaunches it, the relaunch resumes
    from the latest checkpoint, and the run ends with the very weights of a run that never crashed."""
    cli = _pretrain_cli("crashy", sample_manifest, cli_env)
    log = home / "jobs" / "crashy.log"
    deadline = time.monotonic() + 180
    while not (log.exists() and "checkpoint step=40 " in log.read_text()):
        assert time.monotonic() < deadline and cli.poll() is None, cli.communicate()
        time.sleep(0.2)
    # This job's ranks only (`python -u -m tasks.pretrain.train`, not torchrun): other jobs may run beside it.
    ranks = [
        line.split()[0]
        for line in _processes_matching("-m tasks.pretrain.train")
        if " -u " in line and sample_manifest in line and "--run-name crashy " in f"{line} "
    ]
    assert len(ranks) == 2, ranks
    os.kill(int(ranks[0]), signal.SIGKILL)  # one rank dies: torchrun fails the job, the flow relaunches it
    stdout, stderr = cli.communicate(timeout=300)
    assert cli.returncode == 0, stderr
    crashed = json.loads(stdout)
    assert set(crashed) == {"run_id", "checkpoint_uri", "steps", "final_loss", "val_bpc"}
    assert crashed["steps"] == 200
    resumed = _resumed_steps(log, "crashy")
    assert resumed and 40 <= resumed[0] < 200, resumed  # killed mid-run; resumed, not restarted
    assert all(step == 200 for step in resumed[1:]), resumed
    # On the terminal as they happened, not only in the job's log: the crash, the relaunch, the resume.
    crash = stderr.index("crashed: job ")
    relaunch = stderr.index("relaunched job ", crash)
    assert "(attempt 2 of 3)" in stderr[relaunch:].splitlines()[0], stderr
    stderr.index(f"resumed run crashy from step {resumed[0]} ", relaunch)

    straight = _pretrain_cli("straight", sample_manifest, cli_env)
    stdout, stderr = straight.communicate(timeout=300)
    assert straight.returncode == 0, stderr
    uninterrupted = json.loads(stdout)
    assert all(step == 200 for step in _resumed_steps(home / "jobs" / "straight.log", "straight"))
    assert uninterrupted["steps"] == crashed["steps"]
    assert uninterrupted["final_loss"] == crashed["final_loss"]
    assert uninterrupted["val_bpc"] == crashed["val_bpc"]
    # fp32 on CPU, the same reductions in the same order, and a checkpoint that holds everything a
    # step depends on (weights, Adam's moments, the schedule, the carried state): bit for bit.
    a = load_checkpoint(uninterrupted["checkpoint_uri"])
    b = load_checkpoint(crashed["checkpoint_uri"])
    assert a.step == b.step == 200
    assert a.state["model"].keys() == b.state["model"].keys()
    for name, tensor in a.state["model"].items():
        assert torch.equal(b.state["model"][name], tensor), name
    assert torch.equal(b.state["h"], a.state["h"]) and torch.equal(b.state["c"], a.state["c"])
    for index, moments in a.state["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(b.state["optimizer"]["state"][index][key], value), (index, key)


@pytest.mark.slow
def test_one_rank_reads_sigterm_from_its_own_flag_and_tracking_off_keeps_mlflow_out(
    sample_manifest: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No host round trip per step on one rank (on a GPU each was a sync that stalls a captured step):
    the loop reduces values only where it logs and validates; and --tracking off writes no MLflow run."""
    config = TrainConfig(
        corpus=sample_manifest, preset="tiny", run_name="quiet", store=str(home / "store"), batch_size=8,
        seq_len=32, max_steps=12, log_every=6, val_every=100, checkpoint_every=100, tracking="off",
    )  # fmt: skip
    reductions: list[int] = []
    original = World.sum
    monkeypatch.setattr(World, "sum", lambda self, values: reductions.append(1) or original(self, values))
    handler = signal.getsignal(signal.SIGTERM)
    try:
        result = fit(config, World(), get_settings(home=home))
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert result.steps == 12 and result.run_id is None
    assert len(reductions) == 3  # the loss at steps 6 and 12, the validation at the end: not one a step
    assert not (home / "mlflow.db").exists()


def test_a_checkpoint_holds_learning_rates_as_numbers_and_a_resume_restores_floats(
    sample_manifest: str, home: Path
) -> None:
    """A captured step's learning rates are device tensors; saved as such, a launch without the graph
    would take a Tensor for its lr (Adam then leaves its fast path). Here the tensors are made on the CPU."""
    config = TrainConfig(
        corpus=sample_manifest, preset="tiny", run_name="lr", store=str(home / "store"), batch_size=8,
        seq_len=32, tracking="off",
    )  # fmt: skip
    settings = get_settings(home=home)
    captured = Trainer(config, World(), settings)
    for group in captured.optimizer.param_groups:  # as a captured run holds them
        group["lr"], group["initial_lr"] = torch.tensor(group["lr"]), torch.tensor(group["initial_lr"])
    captured.schedule.base_lrs = [torch.tensor(lr) for lr in captured.schedule.base_lrs]
    captured.schedule.step()
    captured.step = 1
    uri = captured.save()
    assert uri is not None
    saved = load_checkpoint(uri).state
    groups = saved["optimizer"]["param_groups"]
    assert all(type(g["lr"]) is float and type(g["initial_lr"]) is float for g in groups), groups
    schedule = saved["schedule"]
    assert all(type(lr) is float for lr in [*schedule["base_lrs"], *schedule["_last_lr"]]), schedule

    resumed = Trainer(config, World(), settings)
    assert resumed.resume()
    resumed.train_step()
    assert all(type(g["lr"]) is float for g in resumed.optimizer.param_groups)
    assert all(type(lr) is float for lr in resumed.schedule.base_lrs)
