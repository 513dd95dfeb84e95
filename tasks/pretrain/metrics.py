"""The training job's metrics: the GPU peaks its ``mfu`` is against, and rank 0's MLflow run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from models.precision import PRECISION_NAMES
from tasks.jobs import joblog
from tasks.jobs.world import World, log
from tasks.settings import Settings

# Dense bf16 tensor-core peaks (FLOP/s) of GPUs by name, for model FLOPs utilisation against the datasheet.
# The `mfu` metric uses a measured peak where one is known (MLSTM_PEAK_FLOPS, or the file
# benchmarks/pretrain.py writes on a GPU, MEASURED_PEAKS under MLSTM_HOME); the datasheet's stays beside it.
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
}
MEASURED_PEAKS = "peak_flops.json"  # {GPU name: {precision: FLOP/s}}, under MLSTM_HOME


def datasheet_flops(device: torch.device) -> float | None:
    """The GPU's datasheet dense bf16 peak, for the GPUs GPU_PEAK_FLOPS names."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_FLOPS.items() if key in name), None)


def measured_flops(device: torch.device, dtype: torch.dtype, home: Path | None) -> float | None:
    """MLSTM_PEAK_FLOPS, else the matmul peak benchmarks/pretrain.py measured on this GPU in this dtype."""
    if os.environ.get("MLSTM_PEAK_FLOPS"):
        return float(os.environ["MLSTM_PEAK_FLOPS"])
    if device.type != "cuda" or home is None:
        return None
    return peak_in_file(home / MEASURED_PEAKS, torch.cuda.get_device_name(device), dtype)


def peak_in_file(path: Path, gpu: str, dtype: torch.dtype) -> float | None:
    """The peak a file of MEASURED_PEAKS holds for this GPU (by name) and precision, if any."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get(gpu, {}).get(PRECISION_NAMES.get(dtype))
    except (ValueError, AttributeError):
        return None  # a damaged file costs the metric, never the run
    return float(value) if value else None


def peak_flops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, home: Path | None = None
) -> float | None:
    """The peak ``mfu`` is against: measured where known, else the datasheet's."""
    return measured_flops(device, dtype, home) or datasheet_flops(device)


class Throughput:
    """Characters a second over a window of steps, and the model FLOPs utilisation that makes against
    each peak known (``mfu`` the measured one, ``mfu_datasheet`` the datasheet's)."""

    def __init__(
        self, world: World, dtype: torch.dtype, home: Path, *, chars_per_step: int, num_params: int
    ) -> None:
        self.world_size, self.chars_per_step = world.size, chars_per_step
        self.flops_per_char = 6 * num_params  # forward 2, backward 4 a parameter
        self.peaks = {
            "mfu": peak_flops(world.device, dtype, home),
            "mfu_datasheet": datasheet_flops(world.device),
        }
        self.restart()

    def restart(self) -> None:
        """A new window, from now (the time spent logging the last one is no step's)."""
        self.start, self.steps = time.perf_counter(), 0

    def chars_per_s(self) -> float:
        return self.steps * self.chars_per_step / (time.perf_counter() - self.start)

    def utilisation(self, chars_per_s: float) -> dict[str, float]:
        """The fraction of each known peak, over every rank, that ``chars_per_s`` computes."""
        flops = self.flops_per_char * chars_per_s
        return {name: flops / (peak * self.world_size) for name, peak in self.peaks.items() if peak}


class Report:
    """What the job tells as it goes: lines of rank 0's log, and the same numbers in its MLflow run
    where one is tracked."""

    def __init__(self, world: World, tracker: Tracker | None) -> None:
        self.world, self.tracker = world, tracker

    def progress(self, step: int, total_steps: int, metrics: dict[str, float]) -> None:
        line = {"step": step, "of": total_steps, **metrics}
        log(self.world, joblog.progress_line(line))
        if self.tracker:
            self.tracker.metrics(metrics, step)

    def validation(self, step: int, val_bpc: float | None) -> None:
        log(self.world, f"validation step={step} val_bpc={val_bpc}")
        if self.tracker and val_bpc is not None:
            self.tracker.metrics({"val_bpc": val_bpc}, step)

    def checkpoint(self, step: int, uri: str | None) -> None:
        if self.tracker and uri:
            self.tracker.checkpoint(uri, step)

    def close(self, *, preempted: bool) -> None:
        if self.tracker:
            self.tracker.close(preempted=preempted)


class Tracker:
    """Rank 0's MLflow run: params once, metrics asynchronously so logging never stalls a step."""

    def __init__(
        self,
        settings: Settings,
        *,
        run_name: str,
        run_id: str | None,
        corpus: str,
        corpus_id: str,
        params: dict[str, Any],
        tags: dict[str, str],
        world: World,
        dtype: torch.dtype,
    ) -> None:
        """Open (or reopen) the run: ``run_id`` a flow's or a resumed run's; ``run_name`` the job's
        ``--run-name``; ``params`` the settings its numbers depend on, logged once; ``tags`` besides the
        stage's own (a continued run's parent)."""
        try:
            import mlflow
        except ImportError as error:
            raise ValueError(
                "MLflow is not installed where rank 0 runs: install it, or pass --tracking off to keep "
                "the run's metrics in its log only"
            ) from error

        from tasks.tracking import start_tracking

        self.mlflow = mlflow
        self.run_name = run_name
        self.run = start_tracking(
            settings,
            run_id=run_id,
            run_name=f"pretrain-{run_name}",
            tags={
                "stage": "pretrain",
                "run": run_name,
                "corpus_id": corpus_id,
                "manifest_uri": corpus,
                **tags,
            },
        )
        with contextlib.suppress(self.mlflow.exceptions.MlflowException):  # same values on a resume
            self.mlflow.log_params({**params, "corpus_id": corpus_id}, run_id=self.run_id)
        self.mlflow.set_tags(
            {
                "world_size": world.size,
                "precision": str(dtype).removeprefix("torch."),
                "device": torch.cuda.get_device_name() if world.device.type == "cuda" else "cpu",
            },
        )

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def metrics(self, values: dict[str, float], step: int) -> None:
        finite = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        self.mlflow.log_metrics(finite, step=step, run_id=self.run_id, synchronous=False)

    def checkpoint(self, uri: str, step: int) -> None:
        self.mlflow.set_tags({"checkpoint_uri": uri, f"checkpoint_step_{step}": uri})

    def close(self, *, preempted: bool) -> None:
        from mlflow.tracking import MlflowClient

        self.mlflow.flush_async_logging()
        with contextlib.suppress(Exception):  # a plot is a convenience: never fail the run over it
            history = MlflowClient().get_metric_history(self.run_id, "loss")
            self._plot(sorted((m.step, m.value) for m in history))
        self.mlflow.end_run("KILLED" if preempted else "FINISHED")

    def _plot(self, points: list[tuple[int, float]]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4))
        axes.plot([s for s, _ in points], [v / math.log(2) for _, v in points])
        axes.set(xlabel="step", ylabel="train bits per character", title=self.run_name)
        axes.grid(alpha=0.3)
        self.mlflow.log_figure(figure, "loss_curve.png")
        plt.close(figure)
