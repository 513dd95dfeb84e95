"""The Slurm launcher: the script it renders and its errors (no Slurm needed; Slurm's commands faked
where one must answer), then a job's whole life on a real cluster (``infra/slurm/local-cluster.sh``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import tasks.jobs.launchers.base
from tasks.jobs.launchers.base import JobHandle, JobSpec, JobState, LaunchError
from tasks.jobs.launchers.slurm import SlurmLauncher
from tasks.pretrain.stage import JOB_MODULE

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SECRET = "wJalrXUtnFEMI-not-a-real-key"


@pytest.fixture(autouse=True)
def infra_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkout's template, wherever pytest runs from (the package is installed non-editable)."""
    monkeypatch.setenv("MLSTM_INFRA_DIR", str(ROOT / "infra"))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path / "slurm"


def _command(script: str) -> list[str]:
    """The srun line of a rendered script as the shell splits it, continuation lines joined."""
    joined = script.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.startswith("srun "))
    return shlex.split(line)


# What it renders


def test_render_gpu_job(workdir: Path) -> None:
    args = ("--corpus", "s3://corpora/a b/manifest.json", "--run", "it's; $HOME `x`", "--preset", "tiny")
    spec = JobSpec(
        name="pretrain-tiny",
        args=args,
        module=JOB_MODULE,
        nodes=4,
        nproc_per_node=8,
        gpus_per_node=8,
        workdir=workdir,
    )
    script = SlurmLauncher(cpus_per_process=4).render(spec)

    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=pretrain-tiny",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=32",
        f"#SBATCH --output={workdir.resolve()}/pretrain-tiny-%j.log",
        "#SBATCH --signal=TERM@120",
        "#SBATCH --export=ALL",
    ]
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    command = _command(script)
    torchrun = command.index(sys.executable)
    assert command[torchrun : torchrun + 3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nnodes $SLURM_NNODES --nproc-per-node 8 --rdzv-id $SLURM_JOB_ID --rdzv-backend c10d" in (
        " ".join(command)
    )
    assert command[command.index("--rdzv-endpoint") + 1] == "$HEAD_NODE:$RDZV_PORT"
    # The job's own arguments come through the shell exactly as given.
    assert command[-len(args) - 2 :] == ["-m", "tasks.pretrain.train", *args]
    assert subprocess.run(["/bin/bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_render_cpu_job_asks_for_no_gpu(workdir: Path) -> None:
    spec = JobSpec(name="probe", args=(), nproc_per_node=2, module="slurm_probe_job", workdir=workdir)
    script = SlurmLauncher().render(spec)
    assert "--gpus-per-node" not in script
    assert "#SBATCH --cpus-per-task=2" in script
    assert _command(script)[-2:] == ["-m", "slurm_probe_job"]


def test_render_makes_any_run_name_safe_for_slurm(workdir: Path) -> None:
    script = SlurmLauncher().render(
        JobSpec(name="my run %j: 1/2", args=(), module=JOB_MODULE, workdir=workdir)
    )
    assert "#SBATCH --job-name=my-run-j-1-2\n" in script
    assert f"#SBATCH --output={workdir.resolve()}/my-run-j-1-2-%j.log\n" in script
    with pytest.raises(ValueError, match="job name"):
        SlurmLauncher().render(JobSpec(name="%%", args=(), module=JOB_MODULE, workdir=workdir))


def test_missing_template_names_every_path_tried(
    tmp_path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLSTM_INFRA_DIR", raising=False)
    # As installed: the package in site-packages, no infra/ beside it, run outside the checkout.
    monkeypatch.setattr(
        tasks.jobs.launchers.base,
        "__file__",
        str(tmp_path / "site-packages" / "tasks" / "jobs" / "launchers" / "base.py"),
    )
    monkeypatch.chdir(tmp_path)
    spec = JobSpec(name="x", args=(), module=JOB_MODULE, workdir=workdir)
    with pytest.raises(LaunchError, match=r"infra/slurm/job\.sbatch is missing") as error:
        SlurmLauncher().render(spec)
    assert str(tmp_path / "site-packages" / "infra" / "slurm" / "job.sbatch") in str(error.value)
    assert str(tmp_path / "infra" / "slurm" / "job.sbatch") in str(error.value)
    monkeypatch.setenv("MLSTM_INFRA_DIR", str(tmp_path / "nowhere"))  # when set, the only place looked
    with pytest.raises(LaunchError, match=re.escape(str(tmp_path / "nowhere" / "slurm"))):
        SlurmLauncher().render(spec)


# Submitting and watching against Slurm's commands, faked


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """``fake(name, body)``: a shell script that stands in for one of Slurm's commands on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def fake(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)

    return fake


def test_submit_passes_secrets_by_environment_only(
    tmp_path: Path, workdir: Path, fake_slurm: Callable[[str, str], None]
) -> None:
    seen = tmp_path / "sbatch-saw"
    fake_slurm("sbatch", f'printf "%s %s" "$AWS_SECRET_ACCESS_KEY" "$2" > {seen}; echo "4242;local"')
    spec = JobSpec(
        name="secret",
        args=("--run", "r"),
        module=JOB_MODULE,
        workdir=workdir,
        env={"AWS_SECRET_ACCESS_KEY": SECRET},
    )

    handle = SlurmLauncher().submit(spec)

    assert handle == JobHandle("slurm", "4242", str(workdir.resolve() / "secret-4242.log"))
    script_path = workdir.resolve() / "secret.sbatch"
    assert seen.read_text() == f"{SECRET} {script_path}"
    assert SECRET not in script_path.read_text()
    assert all(SECRET not in p.read_bytes().decode() for p in workdir.iterdir())


def test_missing_sbatch_says_what_to_do(
    tmp_path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        LaunchError, match="sbatch is not installed: install Slurm's client or use --launcher local"
    ):
        SlurmLauncher().submit(JobSpec(name="probe", args=(), module=JOB_MODULE, workdir=workdir))


def test_sbatch_error_names_command_and_stderr(workdir: Path, fake_slurm: Callable[[str, str], None]) -> None:
    fake_slurm("sbatch", 'echo "sbatch: error: invalid partition specified: gpu" >&2; exit 1')
    with pytest.raises(LaunchError, match=r"`sbatch --parsable .*probe\.sbatch` failed .*invalid partition"):
        SlurmLauncher().submit(JobSpec(name="probe", args=(), module=JOB_MODULE, workdir=workdir))


FORGOTTEN = 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1'


@pytest.mark.parametrize(
    ("scontrol_says", "state", "exit_code", "in_message"),
    [
        ("JobState=COMPLETED Reason=None ExitCode=0:0", JobState.SUCCEEDED, 0, ""),
        ("JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0", JobState.FAILED, 1, "exited with code 1"),
        ("JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15", JobState.FAILED, -15, "time limit"),
        ("JobState=OUT_OF_MEMORY Reason=OutOfMemory ExitCode=0:125", JobState.FAILED, -125, "memory"),
        ("JobState=PREEMPTED Reason=None ExitCode=0:15", JobState.FAILED, -15, "preempted"),
        ("JobState=NODE_FAIL Reason=NodeDown ExitCode=0:0", JobState.FAILED, 0, "lost a node (NodeDown)"),
        ("JobState=CANCELLED Reason=None ExitCode=0:15", JobState.CANCELLED, -15, "cancelled"),
        # Cancelled by another process: its ranks exited non-zero on SIGTERM, so Slurm says FAILED.
        (
            "JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0\n   Comment=mlstm-sentiment:cancelled",
            JobState.CANCELLED,
            1,
            "cancelled",
        ),
    ],
)
def test_status_of_a_job_out_of_the_queue(
    fake_slurm: Callable[[str, str], None],
    scontrol_says: str,
    state: JobState,
    exit_code: int,
    in_message: str,
) -> None:
    fake_slurm("squeue", "exit 0")  # a finished job is no longer listed
    shown = f"JobId=7 JobName=probe\n   {scontrol_says}"
    fake_slurm("scontrol", f"printf '%s\\n' {shlex.quote(shown)}")  # builtins only: PATH may be bare
    status = SlurmLauncher().status(JobHandle("slurm", "7", "/runs/probe-7.log"))
    assert (status.state, status.exit_code) == (state, exit_code)
    assert in_message in status.message
    if state is JobState.FAILED:
        assert "/runs/probe-7.log" in status.message


@pytest.mark.parametrize(
    ("squeue_says", "state"), [("PENDING", JobState.PENDING), ("COMPLETING", JobState.RUNNING)]
)
def test_status_of_a_queued_job(
    fake_slurm: Callable[[str, str], None], squeue_says: str, state: JobState
) -> None:
    fake_slurm("squeue", f"echo {squeue_says}")
    assert SlurmLauncher().status(JobHandle("slurm", "7")).state is state


def test_status_falls_back_to_sacct_and_says_when_nothing_knows_the_job(
    fake_slurm: Callable[[str, str], None],
) -> None:
    fake_slurm("squeue", FORGOTTEN)
    fake_slurm("scontrol", FORGOTTEN)
    fake_slurm("sacct", 'echo "CANCELLED by 0|0:15|"')
    assert SlurmLauncher().status(JobHandle("slurm", "7")).state is JobState.CANCELLED

    fake_slurm("sacct", 'echo "Slurm accounting storage is disabled" >&2; exit 1')
    with pytest.raises(LaunchError, match=r"no longer knows job 7.*accounting storage is disabled"):
        SlurmLauncher().status(JobHandle("slurm", "7"))


def test_status_raises_when_the_controller_is_down(fake_slurm: Callable[[str, str], None]) -> None:
    fake_slurm("squeue", 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    with pytest.raises(LaunchError, match=r"`squeue -h -j 7 -o %T` failed .*Unable to contact"):
        SlurmLauncher().status(JobHandle("slurm", "7"))


# A real cluster


def _cluster_answers() -> str:
    """Why the cluster cannot run the tests, or "" when it can."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (infra/slurm/local-cluster.sh starts a local cluster)"
    try:
        nodes = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"sinfo did not answer: {error}"
    if not {"idle", "mix", "alloc", "comp"} & set(nodes.stdout.split()):
        return f"no Slurm node takes jobs (sinfo: {(nodes.stdout + nodes.stderr).strip()!r})"
    return ""


@pytest.fixture(scope="module")
def cluster() -> None:
    if why := _cluster_answers():
        if os.environ.get("MLSTM_REQUIRE_SLURM") == "1":
            pytest.fail(f"a Slurm cluster is required here (MLSTM_REQUIRE_SLURM=1) but {why}")
        pytest.skip(why)


class _TrackingLauncher(SlurmLauncher):
    """Remembers what it submitted, so that the fixture can clean up whatever a test asserted."""

    def __init__(self) -> None:
        super().__init__(notice_seconds=30, poll_seconds=0.5)
        self.handles: list[JobHandle] = []

    def submit(self, spec: JobSpec) -> JobHandle:
        self.handles.append(super().submit(spec))
        return self.handles[-1]


@pytest.fixture
def launcher(cluster: None) -> Iterator[SlurmLauncher]:
    launcher = _TrackingLauncher()
    yield launcher
    for handle in launcher.handles:
        subprocess.run(["scancel", handle.job_id], capture_output=True, check=False)


def _probe(workdir: Path, name: str, *args: str, nproc_per_node: int = 1) -> JobSpec:
    # The job's python finds the probe beside the tests (the job's environment is this one plus spec.env).
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return JobSpec(
        name=name,
        args=args,
        module="slurm_probe_job",
        nproc_per_node=nproc_per_node,
        env={"PYTHONPATH": path},
        workdir=workdir,
    )


def _wait_for_log(launcher: SlurmLauncher, handle: JobHandle, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while text not in (log := launcher.logs(handle)[0]):
        assert time.monotonic() < deadline, f"no {text!r} in the log within {timeout} s:\n{log}"
        assert not launcher.status(handle).state.finished, f"the job ended before {text!r}:\n{log}"
        time.sleep(0.5)
    return log


@pytest.mark.slow
def test_job_runs_ranks_that_all_reduce(launcher: SlurmLauncher, workdir: Path) -> None:
    handle = launcher.submit(_probe(workdir, "probe-sum", nproc_per_node=2))
    status = launcher.wait(handle, poll_seconds=0.5, timeout=90)
    log, offset = launcher.logs(handle)
    assert (status.state, status.exit_code) == (JobState.SUCCEEDED, 0), log
    assert "probe rank 0/2 sum 3" in log
    assert "probe rank 1/2 sum 3" in log
    assert launcher.logs(handle, offset) == ("", offset)
    # Another process (a fresh launcher) finds the same job from its handle alone.
    assert SlurmLauncher().status(handle).state is JobState.SUCCEEDED


@pytest.mark.slow
def test_cancel_stops_every_process(launcher: SlurmLauncher, workdir: Path) -> None:
    marker = f"probe-{uuid.uuid4().hex}"
    handle = launcher.submit(_probe(workdir, "probe-cancel", "--sleep", "600", "--marker", marker))
    _wait_for_log(launcher, handle, "probe rank 0/1 started")
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True, check=False).returncode == 0

    started = time.monotonic()
    launcher.cancel(handle)

    # SIGTERM reached the ranks at once: no waiting out the notice period.
    assert time.monotonic() - started < launcher.notice_seconds
    assert launcher.status(handle).state is JobState.CANCELLED
    assert SlurmLauncher().status(handle).state is JobState.CANCELLED  # another process sees the same
    assert "probe rank 0 got SIGTERM" in launcher.logs(handle)[0]
    leftover = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True, check=False)
    assert leftover.returncode == 1, f"processes outlived the job:\n{leftover.stdout}"
    launcher.cancel(handle)  # a no-op once it has ended


@pytest.fixture
def busy_cluster(cluster: None, launcher: SlurmLauncher) -> Iterator[None]:
    """Every node taken by a job that sleeps, so that the next job waits in the queue."""
    command = ["sbatch", "--parsable", "--exclusive", "--job-name=probe-blocker", "-o", "/dev/null"]
    blocker = subprocess.run([*command, "--wrap", "sleep 120"], capture_output=True, text=True, check=True)
    handle = JobHandle("slurm", blocker.stdout.strip().split(";")[0])
    try:
        deadline = time.monotonic() + 30
        while launcher.status(handle).state is not JobState.RUNNING:
            assert time.monotonic() < deadline, "the blocking job did not start within 30 s"
            time.sleep(0.2)
        yield
    finally:
        subprocess.run(["scancel", handle.job_id], capture_output=True, check=False)


@pytest.mark.slow
def test_cancel_a_job_that_has_not_started(
    launcher: SlurmLauncher, workdir: Path, busy_cluster: None
) -> None:
    handle = launcher.submit(_probe(workdir, "probe-later"))
    assert (status := launcher.status(handle)).state is JobState.PENDING, status
    launcher.cancel(handle)
    assert (status := launcher.status(handle)).state is JobState.CANCELLED, status
    assert not Path(handle.log_path).exists()  # it never ran


@pytest.mark.slow
def test_failing_job_reports_failure(launcher: SlurmLauncher, workdir: Path) -> None:
    handle = launcher.submit(_probe(workdir, "probe-fail", "--fail", "3"))
    status = launcher.wait(handle, poll_seconds=0.5, timeout=90)
    log = launcher.logs(handle)[0]
    assert status.state is JobState.FAILED, log
    assert status.exit_code not in (0, None)
    assert "exited with code" in status.message
    assert handle.log_path in status.message
    assert "probe rank 0 failing with 3" in log


@pytest.mark.slow
def test_pretrain_runs_the_training_job_on_slurm(
    cluster: None, sample_manifest: str, tmp_path: Path, prefect_api_url: str
) -> None:
    """The real thing: `mlstm-sentiment pretrain --launcher slurm`, sbatch, srun torchrun, two ranks."""
    cli = str(Path(sys.executable).parent / "mlstm-sentiment")
    env = {**os.environ, "MLSTM_HOME": str(tmp_path / "home"), "PREFECT_API_URL": prefect_api_url}
    args = [
        "pretrain",
        "--corpus",
        sample_manifest,
        "--launcher",
        "slurm",
        "--nproc",
        "2",
        "--run",
        "on-slurm",
    ]
    args += [
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--max-steps",
        "20",
        "--checkpoint-every",
        "10",
        "--json",
    ]
    done = subprocess.run([cli, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["steps"] == 20 and result["checkpoint_uri"].endswith(
        "runs/on-slurm/checkpoints/step-0000020"
    )
    log = next((tmp_path / "home" / "jobs").glob("on-slurm-*.log")).read_text()
    assert "run on-slurm: tiny" in log and "2 rank(s) on cpu" in log  # srun → torchrun → two ranks
    assert (tmp_path / "home" / "jobs" / "on-slurm.sbatch").is_file()


def test_finetune_runs_on_slurm_with_two_ranks(cluster: None, tmp_path: Path, prefect_api_url: str) -> None:
    """`mlstm-sentiment finetune --launcher slurm`: the pretraining job's launcher runs the fine-tuning
    job (sbatch, srun torchrun, two gloo ranks) and the result is registered as with torchrun here."""
    from finetune_helpers import early_byte_splits, tiny_checkpoint

    home = tmp_path / "home"
    checkpoint = tiny_checkpoint(home / "store")
    data = early_byte_splits(tmp_path / "early")
    cli = str(Path(sys.executable).parent / "mlstm-sentiment")
    env = {**os.environ, "MLSTM_HOME": str(home), "PREFECT_API_URL": prefect_api_url}
    args = [cli, "finetune", "--checkpoint", checkpoint, "--dataset", f"early={data}", "--launcher", "slurm"]
    args += ["--nproc", "2", "--run", "ft-on-slurm", "--epochs", "1", "--batch-size", "16", "--json"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == 1 and result["promoted"], result  # the first version: champion
    log = next((home / "jobs").glob("ft-on-slurm-*.log")).read_text()
    assert "2 rank(s) on cpu" in log  # srun → torchrun → two ranks
    assert (home / "jobs" / "ft-on-slurm.sbatch").is_file()
