"""benchmarks/finetune.py: a benchmark whose in-process job is stopped records nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import load_benchmark

from tasks.pretrain import world


def test_a_sigterm_to_the_pretraining_job_stops_the_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The job checkpoints and returns on SIGTERM, as a scheduler's preemption wants; the benchmark must
    # then stop, not fine-tune and record from the unfinished checkpoint.
    module = load_benchmark("finetune.py", "finetune_benchmark", monkeypatch)
    stops_after = world.Preempted.stops_after

    def signalled_at_step_2(self: world.Preempted, step: int, stop: int) -> bool:
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, to the job's own handler
        return stops_after(self, step, stop)

    monkeypatch.setattr(world.Preempted, "stops_after", signalled_at_step_2)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit, match="the pretraining job was stopped at step 2; nothing recorded"):
            module.pretrained_checkpoint(tmp_path, "tiny", 20)
    finally:
        signal.signal(signal.SIGTERM, handler)
