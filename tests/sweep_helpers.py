"""A sweep spec for the sweep tests and a stand-in job that replays an objective (``test_sweep.py``,
``test_sweep_asha.py``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from tasks.pretrain.config import PretrainParams
from tasks.pretrain.result import PretrainResult

CLI = str(Path(sys.executable).parent / "mlstm-sentiment")

SPEC = """\
corpus: {corpus}
preset: tiny
seq_len: 32
log_every: 1
objective: val_bpc
budget: {{trials: {trials}, max_steps: {max_steps}}}
asha: {{min_steps: 1, eta: 3}}   # rungs at 1, 3, 9, … steps up to max_steps
sampler: random
seed: {seed}
space:
  lr: {{log_uniform: [1.0e-4, 3.0e-2]}}
  batch_size: {{choice: [8, 16]}}
"""


def write_spec(
    path: Path, corpus: str = "newest", *, trials: int = 6, seed: int = 0, max_steps: int = 9, extra: str = ""
) -> Path:
    path.write_text(SPEC.format(corpus=corpus, trials=trials, seed=seed, max_steps=max_steps) + extra)
    return path


class Replay:
    """A stand-in job whose val_bpc is a fixed function of lr and steps, and whose runs keep their
    step like checkpoints do: enough to check the rung logic and the bookkeeping in milliseconds.
    (``test_sweep.py``'s long tests run the real job.)"""

    def __init__(self, fail_at: int | None = None) -> None:
        self.steps: dict[str, int] = {}
        self.launches: list[tuple[str, int, int]] = []  # (run, from step, to step)
        self.fail_at = fail_at

    def __call__(self, params: PretrainParams) -> PretrainResult:
        if self.fail_at is not None and len(self.launches) == self.fail_at:
            raise KeyboardInterrupt  # the worker dies mid-sweep, telling Optuna nothing
        assert params.run and params.max_steps
        start = self.steps.get(params.run, 0)
        self.launches.append((params.run, start, params.max_steps))
        self.steps[params.run] = max(start, params.max_steps)
        value = self.objective(params)
        return PretrainResult(
            run=params.run, run_id=None, checkpoint_uri="x", steps=self.steps[params.run],
            total_steps=params.total_steps or params.max_steps, final_loss=value, val_bpc=value,
        )  # fmt: skip

    def objective(self, params: PretrainParams) -> float:
        return 8 - math.log10(params.lr) * 0.1 * math.log1p(params.max_steps)  # higher lr, lower bpc

    def order(self) -> list[tuple[int, int, int]]:
        """The launches as (trial number, from step, to step)."""
        return [(int(run.rsplit("-t", 1)[1]), a, b) for run, a, b in self.launches]
