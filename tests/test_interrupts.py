"""Ctrl-C and SIGTERM on the long commands, as a terminal and a process manager send them: the command
exits with one line and 130 or 143, its job checkpointed, and nothing it started is left running; a
CLI killed outright takes its job with it; a job's resume reaches the terminal (its crash and relaunch:
``test_pretrain.py::test_the_flow_retries_a_crashed_job_from_latest``).

Each test runs the real command line on the tiny preset and a small generated corpus, and signals it
once its job (or its scoring) is under way. A process "left running" is any whose environment holds
the test's MLSTM_HOME (``/proc/*/environ``), whatever its parent became.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import cli_in_process
from finetune_helpers import early_byte_splits, tiny_checkpoint

from tasks.corpus.sample import write_labelled_sample, write_sample
from tasks.jobs.checkpoint import read_latest
from tasks.store import LocalStore

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="reads /proc; the parent-death signal is Linux's"
)

BIN = Path(sys.executable).parent
CLI = str(BIN / "mlstm-sentiment")
# Steps of 8 rows × 32 bytes, a progress line each: the job is under way at its first line.
FAST = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--log-every", "1"]
# The rule is 10 s (measured on the shared two cores: pretrain 9.2 and 11.2 s at a lighter load, 28 to
# 34 s at load 16, most of it the rank's, torchrun's and the interpreters' exits). The bound catches a
# hang: before, the CLI was still running 213 s after Ctrl-C.
STOPS_WITHIN_S = 60
START_WITHIN_S = 400  # a CLI, a Prefect API and torchrun starting on a busy machine


@dataclass
class Command:
    """A CLI process in a session of its own (as a terminal starts it) and what it printed."""

    process: subprocess.Popen[bytes]
    home: Path
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_WITHIN_S
        while not condition():
            assert self.process.poll() is None, (
                f"exited {self.process.returncode} before {what}:\n{self.output}"
            )
            assert time.monotonic() < deadline, f"no {what} in {START_WITHIN_S} s:\n{self.output}"
            time.sleep(0.2)

    def job_log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted((self.home / "jobs").glob("*.log")))

    def signal(self, sig: int, *, group: bool) -> float:
        """Send ``sig`` to the CLI (its whole group, as Ctrl-C does, or the CLI alone); seconds to its exit."""
        start = time.monotonic()
        (os.killpg if group else os.kill)(self.process.pid, sig)
        try:
            self.process.wait(timeout=STOPS_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOPS_WITHIN_S} s after signal {sig}:\n{self.output}")
        return time.monotonic() - start


@pytest.fixture(scope="module")
def mlflow_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow database (its tables, no experiment of ours), which each test's home starts
    with: MLflow's migrations that create one take 2.6 s of CPU and 5 s on two cores, in every command
    that finds none, and no rule here is about a home's first command."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("interrupts-mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def cli(
    tmp_path: Path, request: pytest.FixtureRequest, mlflow_database: Path
) -> Iterator[Callable[..., Command]]:
    """``cli(args, own_api=False)`` starts ``mlstm-sentiment ARGS`` with this test's MLSTM_HOME, against
    the session's Prefect API or (``own_api``) its own temporary one; nothing is left at the end. The
    home holds an MLflow database already, as after a user's first command (``mlflow_database``)."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copyfile(mlflow_database, home / "mlflow.db")
    started: list[Command] = []

    def start(args: list[str], *, own_api: bool = False) -> Command:
        env = {**os.environ, "MLSTM_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        if own_api:
            env.pop("PREFECT_API_URL", None)
        else:  # the session's, started once for every test that asks
            env["PREFECT_API_URL"] = request.getfixturevalue("prefect_api_url")
        process = subprocess.Popen(
            [CLI, *args], env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        command = Command(process, home)
        threading.Thread(target=_read, args=(command,), daemon=True).start()
        started.append(command)
        return command

    yield start
    for command in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(command.process.pid, signal.SIGKILL)
        command.process.wait()
    for line in left_running(home):
        os.kill(int(line.split()[0]), signal.SIGKILL)


def _read(command: Command) -> None:
    assert command.process.stdout is not None
    for line in command.process.stdout:
        command.lines.append(line.decode(errors="replace"))


def left_running(home: Path) -> list[str]:
    """``PID command`` of every live process whose environment holds MLSTM_HOME=home."""
    marker = f"MLSTM_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found.append(f"{entry.name} {command}")
    return found


def assert_nothing_left(home: Path, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s  # a reaped process may take a moment to leave /proc
    while (left := left_running(home)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "left running:\n" + "\n".join(left)
    assert not list(home.glob("**/*.rendezvous"))


def assert_one_line(command: Command, word: str) -> str:
    """The command's last word is one ``word:`` line, with no traceback or HTTP noise before it."""
    assert "Traceback" not in command.output and "httpx" not in command.output, command.output
    said = [line for line in command.lines if line.startswith(f"{word}:")]
    assert len(said) == 1 and "run the same command again to resume" in said[0], command.output
    return said[0]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A corpus of generated reviews long enough that no test's job ends before it is signalled."""
    from corpus_helpers import build

    from tasks.corpus.build import CorpusConfig

    root = tmp_path_factory.mktemp("interrupts-corpus")
    built = build(
        write_sample(root / "raw", num_reviews=1500), root / "store", CorpusConfig(split=(18, 1, 1))
    )
    return str(root / "store" / "corpora" / built.corpus_id / "manifest.json")


@pytest.mark.slow
def test_ctrl_c_on_pretrain_checkpoints_stops_everything_and_a_rerun_resumes(
    cli: Callable[..., Command], manifest: str, request: pytest.FixtureRequest
) -> None:
    """SIGINT to the CLI's group (its own temporary Prefect API included, as a terminal's Ctrl-C): 130,
    one line naming the step, no process left; the same command again resumes there, and says so."""
    args = ["pretrain", "--corpus", manifest, *FAST, "--run", "ctrl-c"]
    command = cli(args, own_api=True)
    command.wait_until(lambda: "progress step=" in command.job_log(), "first step")
    seconds = command.signal(signal.SIGINT, group=True)
    assert command.process.returncode == 130, command.output
    line = assert_one_line(command, "interrupted")
    assert_nothing_left(command.home)
    latest = read_latest(LocalStore(command.home / "store"), "ctrl-c")
    assert latest is not None and f"run ctrl-c checkpointed at step {latest['step']};" in line, line
    print(f"stopped in {seconds:.1f} s")

    # The rerun in this process: its subject is the resume, not a process receiving a signal, and it
    # spares an interpreter importing Prefect, torch and MLflow.
    env = {"MLSTM_HOME": str(command.home), "PREFECT_API_URL": request.getfixturevalue("prefect_api_url")}
    again = cli_in_process([*args, "--max-steps", str(latest["step"] + 2)], env)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said
    assert f"resumed run ctrl-c from step {latest['step']} " in said  # on the terminal


@pytest.mark.slow
def test_a_cli_killed_outright_takes_its_job_with_it(cli: Callable[..., Command], manifest: str) -> None:
    """SIGKILL to the CLI alone: torchrun and the temporary Prefect API (each in a session of its own)
    and the rank still stop, within seconds, the rank checkpointing first; the rendezvous file the CLI
    could not remove is cleared by the next launch."""
    from tasks.jobs.launchers.local import clear_stale_rendezvous

    command = cli(["pretrain", "--corpus", manifest, *FAST, "--run", "killed"], own_api=True)
    command.wait_until(lambda: "progress step=" in command.job_log(), "first step")
    os.kill(command.process.pid, signal.SIGKILL)
    command.process.wait()
    deadline = time.monotonic() + STOPS_WITHIN_S
    while left_running(command.home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left_running(command.home), left_running(command.home)
    assert "SIGTERM: checkpointed at step" in command.job_log()
    stale = list((command.home / "jobs").glob("*.rendezvous"))
    assert len(stale) == 1
    assert clear_stale_rendezvous(command.home / "jobs") == stale  # what submit does first
    assert not stale[0].exists()


@pytest.mark.slow
def test_ctrl_c_on_finetune_checkpoints_and_stops_everything(
    cli: Callable[..., Command], tmp_path: Path
) -> None:
    data = early_byte_splits(tmp_path / "early")
    checkpoint = tiny_checkpoint(tmp_path / "home" / "store")
    args = ["finetune", "--checkpoint", checkpoint, "--dataset", f"early={data}", "--run", "tuned"]
    command = cli([*args, "--epochs", "200", "--batch-size", "8", "--log-every", "1"])
    command.wait_until(lambda: "progress step=" in command.job_log(), "first step")
    command.signal(signal.SIGINT, group=True)
    assert command.process.returncode == 130, command.output
    line = assert_one_line(command, "interrupted")
    assert "run tuned checkpointed at step" in line, line
    assert_nothing_left(command.home)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "group", "code", "word", "own_api"),
    [(signal.SIGINT, True, 130, "interrupted", False), (signal.SIGTERM, False, 143, "terminated", True)],
)
def test_pipeline_stops_on_ctrl_c_and_sigterm(
    cli: Callable[..., Command], tmp_path: Path, sig: int, group: bool, code: int, word: str, own_api: bool
) -> None:
    """The pipeline signalled in its pretraining stage: the stage's job checkpoints, the pipeline's flow
    runs end, nothing is left. SIGTERM goes to the CLI process alone (a process manager's stop), with
    its own temporary Prefect API, which must stop with it although the signal never reached it."""
    sample = write_sample(tmp_path / "sample", num_reviews=1500)[0].parent
    labelled = write_labelled_sample(tmp_path / "labelled", num_reviews=300)
    command = cli(
        ["pipeline", str(sample), "--dataset", f"sample={labelled}", "--set", "pretrain.batch_size=8",
         "--set", "pretrain.seq_len=32", "--set", "pretrain.log_every=1"], own_api=own_api,
    )  # fmt: skip
    command.wait_until(lambda: "progress step=" in command.job_log(), "first step")
    command.signal(sig, group=group)
    assert command.process.returncode == code, command.output
    line = assert_one_line(command, word)
    assert "checkpointed at step" in line, line
    assert_nothing_left(command.home)


@pytest.mark.slow
def test_ctrl_c_on_score_stops_its_workers(cli: Callable[..., Command], tmp_path: Path) -> None:
    """``score`` signalled once its first piece is published: 130, one line, no worker left."""
    write_classifier(tmp_path / "home")
    inputs = write_labelled_sample(tmp_path / "texts", num_reviews=3000) / "train.csv"  # ~1,700 rows
    output = tmp_path / "scores"
    command = cli(["score", str(inputs), "--output", str(output), "--piece-rows", "50", "--workers", "2"])
    command.wait_until(lambda: bool(list(output.glob("*/pieces/*.json"))), "first piece")
    command.signal(signal.SIGINT, group=True)
    assert command.process.returncode == 130, command.output
    assert_one_line(command, "interrupted")
    assert_nothing_left(command.home)


@pytest.mark.slow
def test_ctrl_c_on_a_score_of_one_piece_stops_the_piece(
    cli: Callable[..., Command], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api_url: str
) -> None:
    """A table of one piece is scored on a thread of the command, not a pool's worker
    (``flows.runtime.runner_for``): Ctrl-C stops the piece at its next batch, unpublished, so that a rerun
    scores it, instead of the command finishing the whole piece before it exits."""
    write_classifier(tmp_path / "home")
    inputs = write_labelled_sample(tmp_path / "texts", num_reviews=60_000) / "train.csv"  # ~37,000 rows
    output = tmp_path / "scores"
    monkeypatch.setenv("MLSTM_SCORE_MEMORY_MIB", "16")  # many batches, each a chance to stop
    command = cli(["score", str(inputs), "--output", str(output), "--piece-rows", "100000"])
    command.wait_until(lambda: _piece_running(str(output)), "the piece running")
    command.signal(signal.SIGINT, group=True)  # its window read and model load come first: then batches
    assert command.process.returncode == 130, command.output
    assert_one_line(command, "interrupted")
    assert not list(output.glob("*/pieces/*.json")), f"the piece was finished after Ctrl-C:\n{command.output}"
    assert_nothing_left(command.home)


def _piece_running(output: str) -> bool:
    """Whether the score flow run writing to ``output`` has a piece task running (the session's API)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as prefect:
        ours = [r for r in prefect.read_flow_runs(limit=50) if r.parameters.get("output") == output]
        if not ours:
            return False
        tasks = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[ours[0].id])))
    return any(t.name.startswith("score piece") and t.state_type == "RUNNING" for t in tasks)


def write_classifier(home: Path) -> None:
    """A tiny classifier (a random mLSTM and probe) registered as the champion in ``home``'s MLflow."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.tracking import MlflowClient

    from models.classifier import SentimentClassifier
    from models.mlstm import MLSTM, tiny
    from tasks.settings import get_settings
    from tasks.tracking import connect
    from tasks.transfer.registry import log_classifier

    torch.manual_seed(0)
    model = MLSTM(tiny())
    coef_H = np.random.default_rng(0).normal(size=model.config.hidden_size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLSTM_HOME", str(home))
        settings = get_settings()
        connect(settings)
        with mlflow.start_run() as run:
            pass
        uri = log_classifier(run.info.run_id, SentimentClassifier(model, coef_H, 0.0), "classifier")
        version = mlflow.register_model(uri, settings.model_name)
        MlflowClient().set_registered_model_alias(settings.model_name, "champion", version.version)


def test_a_stale_rendezvous_file_is_cleared_and_a_live_launcher_s_kept(tmp_path: Path) -> None:
    """The next launch removes the rendezvous file of a launcher that is gone, not a running one's."""
    from tasks.jobs.launchers.local import clear_stale_rendezvous

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"run-a-{gone.pid}-0123abcd.rendezvous"
    live = tmp_path / f"run-b-{os.getpid()}-4567ef01.rendezvous"
    foreign = tmp_path / "someone-else.rendezvous"
    for path in (stale, live, foreign):
        path.write_text("")
    assert clear_stale_rendezvous(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and foreign.exists()


def test_sigterm_and_ctrl_c_become_one_line_with_the_job_s_step_and_the_shell_s_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In this process: a real SIGTERM inside ``stoppable`` is exit 143 and a ``terminated:`` line; a
    Ctrl-C carrying the stopped job's note is exit 130 and an ``interrupted:`` line naming the step."""
    import typer

    from flows.cli.interrupts import stoppable

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(typer.Exit) as ended, stoppable():
        signal.raise_signal(signal.SIGTERM)
        time.sleep(5)  # the handler raises first
    assert ended.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == before
    assert capsys.readouterr().err.startswith("terminated: nothing is left running; run the same command")

    interrupt = KeyboardInterrupt()
    interrupt.add_note("run r1 checkpointed at step 7")
    with pytest.raises(typer.Exit) as ended, stoppable():
        raise interrupt
    assert ended.value.exit_code == 130
    said = capsys.readouterr().err
    assert said == "interrupted: run r1 checkpointed at step 7; run the same command again to resume\n", said


def test_the_console_leaves_out_prefect_s_crash_lines_for_a_signal_only() -> None:
    """The terminal's one line replaces Prefect's "Crash detected!" lines for Ctrl-C and SIGTERM; a crash
    for any other reason still shows."""
    import logging

    from flows.console import ConsoleWithoutTracebacks

    handler = ConsoleWithoutTracebacks()

    def shown(message: str) -> bool:
        return bool(handler.filter(logging.LogRecord("prefect", logging.ERROR, "", 0, message, None, None)))

    assert not shown("Crash detected! Execution was aborted by an interrupt signal.")
    assert not shown("Finished in state Crashed('Execution was aborted by a termination signal.')")
    assert shown("Crash detected! Execution was aborted by Python system exit call.")
    assert shown("Finished in state Failed('job 7 failed')")
