"""The pretraining stage's result: what a run hands on to transfer and fine-tuning, and what the CLI,
the pipeline and a sweep read of it. Built in one place from a run's ``latest.json`` (the flow, a
skipped pipeline stage) or from the job's own state (``FitResult``, the job's last log line)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class PretrainResult(BaseModel):
    """A training run where it stands: its newest checkpoint, the steps done and its last losses."""

    model_config = ConfigDict(frozen=True)

    run: str
    run_id: str | None  # the MLflow run; None when the job was not tracked
    checkpoint_uri: str | None  # None only on ranks other than 0 of a job: rank 0 writes the checkpoints
    steps: int
    total_steps: int
    final_loss: float  # nats per byte, the last logged step's (NaN before any)
    val_bpc: float | None  # None while no validation ran (or the val split is shorter than a row)

    @classmethod
    def from_latest(cls, run: str, latest: dict[str, Any]) -> PretrainResult:
        """A run's result from its ``latest.json`` (whose ``loss`` is the result's ``final_loss``)."""
        return cls(
            run=run,
            run_id=latest.get("mlflow_run_id"),
            checkpoint_uri=latest["checkpoint_uri"],
            steps=latest["step"],
            total_steps=latest["total_steps"],
            final_loss=latest["loss"],
            val_bpc=latest["val_bpc"],
        )


class FitResult(PretrainResult):
    """What one launch of the job did, as its last log line says: the run's result, the fp16 steps the
    loss scaler skipped, and whether SIGTERM stopped it before its last step."""

    skipped_steps: int
    preempted: bool
