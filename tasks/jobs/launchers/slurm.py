"""The Slurm launcher: renders ``infra/slurm/job.sbatch`` for a job and drives it with Slurm's CLI.

``sbatch`` submits, ``squeue`` → ``scontrol`` → ``sacct`` answer for the job as it leaves the queue and
then the controller's memory, ``scancel`` stops it. The submitting environment plus ``spec.env`` is the
job's environment (``--export=ALL``): nothing from ``spec.env`` is ever written into the script.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import string
import subprocess
import sys
import time

from tasks.jobs.launchers.base import (
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LaunchError,
    infra_file,
    read_log,
)

TEMPLATE = "slurm/job.sbatch"
# A job's name ends up in file names and #SBATCH lines: nothing a shell or Slurm's %-patterns would read.
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# Set on a job's Comment when it is cancelled, so that any process can tell a job stopped on request
# (torchrun exits non-zero on SIGTERM, which Slurm records as FAILED) from one that failed.
CANCEL_MARK = "mlstm-sentiment:cancelled"

_SLURM_STATES = {
    **dict.fromkeys(
        ["PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"],
        JobState.PENDING,
    ),
    **dict.fromkeys(
        ["RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"],
        JobState.RUNNING,
    ),
    "COMPLETED": JobState.SUCCEEDED,
    "CANCELLED": JobState.CANCELLED,
}
_FAILURES = {
    "FAILED": "exited with an error",
    "TIMEOUT": "reached its time limit (relaunch the same --run to resume from its last checkpoint)",
    "PREEMPTED": "was preempted (relaunch the same --run to resume from its last checkpoint)",
    "NODE_FAIL": "lost a node",
    "OUT_OF_MEMORY": "ran out of memory",
    "BOOT_FAIL": "could not boot its nodes",
    "DEADLINE": "missed its deadline",
    "REVOKED": "was revoked",
    "SPECIAL_EXIT": "exited with a special exit code",
}


def slurm_name(name: str) -> str:
    """A job's name as Slurm and its files get it: runs of other characters become one '-'."""
    safe = _UNSAFE.sub("-", name).strip("-")
    if not safe:
        raise ValueError(f"the job name {name!r} has no letter or digit to name a Slurm job by")
    return safe


class SlurmLauncher(Launcher):
    """One ``srun torchrun`` per node of an ``sbatch`` allocation; c10d rendezvous on the first node."""

    name = "slurm"

    def __init__(self, *, cpus_per_process: int = 1, notice_seconds: int = 120, poll_seconds: float = 1.0):
        if cpus_per_process < 1 or notice_seconds < 1:
            raise ValueError(
                f"cpus_per_process and notice_seconds must be positive, got {cpus_per_process} "
                f"and {notice_seconds}"
            )
        self.cpus_per_process = cpus_per_process
        # How long a job has to checkpoint after SIGTERM: before its time limit, on preemption and on cancel.
        self.notice_seconds = notice_seconds
        self.poll_seconds = poll_seconds
        self._cancelled: set[str] = set()

    # Submitting

    def render(self, spec: JobSpec) -> str:
        """The sbatch script of a job: its shape and command only, no environment values."""
        name = slurm_name(spec.name)
        workdir = spec.workdir.resolve()
        gpus = f"#SBATCH --gpus-per-node={spec.gpus_per_node}" if spec.gpus_per_node else "# a CPU job"
        values = {
            "job_name": name,
            "nodes": str(spec.nodes),
            "gpus_directive": gpus,
            "cpus_per_task": str(spec.nproc_per_node * self.cpus_per_process),
            # %j is the job id to Slurm, so a literal % in the folder is doubled.
            "output": shlex.quote(f"{str(workdir).replace('%', '%%')}/{name}-%j.log"),
            "notice_seconds": str(self.notice_seconds),
            # torchrun kills ranks still running this long after SIGTERM: inside the notice.
            "shutdown_seconds": str(max(1, self.notice_seconds - 10)),
            "nproc_per_node": str(spec.nproc_per_node),
            # The interpreter of this install, so the job runs the same code and packages.
            "python": shlex.quote(sys.executable),
            "job_command": shlex.join(spec.job_command()),
        }
        path = infra_file(TEMPLATE)
        template = string.Template(path.read_text())
        # Lowercase names are ours, uppercase ones the shell's: a lowercase one we do not fill is a typo.
        unknown = {n for n in template.get_identifiers() if n.islower()} - values.keys()
        if unknown:
            raise LaunchError(f"{path} names unknown fields: {', '.join(sorted(unknown))}")
        return template.safe_substitute(values)

    def submit(self, spec: JobSpec) -> JobHandle:
        script = self.render(spec)
        name, workdir = slurm_name(spec.name), spec.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        script_path = workdir / f"{name}.sbatch"
        script_path.write_text(script)
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        submitted = _slurm(["sbatch", "--parsable", str(script_path)], env=env)
        # --parsable prints "id" or "id;cluster".
        job_id = submitted.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise LaunchError(f"sbatch {script_path} answered {submitted.stdout.strip()!r}, not a job id")
        return JobHandle(self.name, job_id, str(workdir / f"{name}-{job_id}.log"))

    # Watching

    def status(self, handle: JobHandle) -> JobStatus:
        state, exit_code, reason, comment = self._slurm_state(handle.job_id)
        cancelled = handle.job_id in self._cancelled or CANCEL_MARK in comment
        if state == "CANCELLED" or (cancelled and state in _FAILURES):
            return JobStatus(JobState.CANCELLED, exit_code, "cancelled")
        if state in _SLURM_STATES:
            return JobStatus(_SLURM_STATES[state], exit_code)
        if state in _FAILURES:
            detail = f"exited with code {exit_code}" if state == "FAILED" else _FAILURES[state]
            reason = f" ({reason})" if reason and reason not in ("None", "NonZeroExitCode") else ""
            message = f"Slurm job {handle.job_id} {detail}{reason}; log: {handle.log_path}"
            return JobStatus(JobState.FAILED, exit_code, message)
        raise LaunchError(f"Slurm job {handle.job_id} is in state {state}, which this launcher does not know")

    def _slurm_state(self, job_id: str) -> tuple[str, int | None, str, str]:
        """(Slurm state, exit code, reason, comment) from whichever of Slurm's tools still knows the job."""
        queued = _slurm(["squeue", "-h", "-j", job_id, "-o", "%T"], forgotten_ok=True)
        state = queued.stdout.strip()
        if _SLURM_STATES.get(state) in (JobState.PENDING, JobState.RUNNING):
            return state, None, "", ""
        # Out of the queue: the controller remembers it for MinJobAge (300 s by default).
        shown = _slurm(["scontrol", "show", "job", job_id], forgotten_ok=True)
        if shown.returncode == 0 and (match := re.search(r"\bJobState=(\S+)", shown.stdout)):
            fields = dict(re.findall(r"\b(ExitCode|Reason)=(\S+)", shown.stdout))
            comment = re.search(r"^\s*Comment=(.*)$", shown.stdout, re.MULTILINE)
            return (
                match[1],
                _exit_code(fields.get("ExitCode", "")),
                fields.get("Reason", ""),
                comment[1].strip() if comment else "",
            )
        # Last resort: accounting, which a cluster may not keep.
        command = ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,Comment"]
        accounted = _slurm(command, forgotten_ok=True)
        line = accounted.stdout.strip().splitlines()[0] if accounted.stdout.strip() else ""
        if accounted.returncode != 0 or not line:
            why = accounted.stderr.strip() or "no record"
            raise LaunchError(
                f"Slurm no longer knows job {job_id}: squeue and scontrol have forgotten it and "
                f"`{shlex.join(command)}` answered: {why}"
            )
        fields_of_sacct = [*line.split("|", 2), "", ""]
        # sacct writes "CANCELLED by 0".
        return fields_of_sacct[0].split()[0], _exit_code(fields_of_sacct[1]), "", fields_of_sacct[2]

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        return read_log(handle.log_path, offset)

    # Stopping

    def cancel(self, handle: JobHandle) -> None:
        status = self.status(handle)
        if status.state.finished:
            return
        self._cancelled.add(handle.job_id)
        # For other processes watching the same job; without it they only see it FAILED.
        with contextlib.suppress(LaunchError):
            _slurm(["scontrol", "update", f"JobId={handle.job_id}", f"Comment={CANCEL_MARK}"])
        if status.state is JobState.RUNNING:
            # SIGTERM to every process of the job's steps (torchrun and the ranks, which checkpoint) but
            # not to the batch shell, which waits for them. Then the notice period, as before a time limit.
            _slurm(["scancel", "--signal=TERM", handle.job_id], forgotten_ok=True)
            deadline = time.monotonic() + self.notice_seconds
            while not self.status(handle).state.finished and time.monotonic() < deadline:
                time.sleep(self.poll_seconds)
        # Whatever is left (or a job that never started): Slurm's SIGTERM, KillWait, SIGKILL.
        _slurm(["scancel", handle.job_id], forgotten_ok=True)
        self.wait(handle, poll_seconds=self.poll_seconds, timeout=self.notice_seconds)


def _exit_code(text: str) -> int | None:
    """Slurm's "code:signal": the code, or minus the signal that killed the job (as Popen has it)."""
    code, _, sig = text.partition(":")
    if not code.isdigit():
        return None
    return -int(sig) if sig.isdigit() and int(sig) else int(code)


def _slurm(
    command: list[str], *, env: dict[str, str] | None = None, forgotten_ok: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run one of Slurm's commands; ``LaunchError`` naming it when it is missing or fails.

    ``forgotten_ok``: an unknown job id (or disabled accounting) is an answer, not an error.
    """
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
    except FileNotFoundError:
        raise LaunchError(
            f"{command[0]} is not installed: install Slurm's client or use --launcher local"
        ) from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{shlex.join(command)}` did not answer within 60 s") from None
    forgotten = "Invalid job id" in done.stderr or "accounting storage is disabled" in done.stderr
    if done.returncode != 0 and not (forgotten_ok and forgotten):
        raise LaunchError(
            f"`{shlex.join(command)}` failed with exit code {done.returncode}: {done.stderr.strip()}"
        )
    return done
