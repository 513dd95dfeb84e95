"""The sweep's result: every trial where it stands and the best finished one; what ``sweep --json``
prints, the sweep's MLflow run keeps (``sweep.json``) and ``pipeline --from-sweep`` starts from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# A trial's sampled settings (the spec's space: integers, floats, choices).
TrialValues = dict[str, int | float | str | bool]


class TrialRow(BaseModel):
    """One trial: its state, the rungs it reached, its steps, its objective (val bpc) and run name."""

    model_config = ConfigDict(frozen=True)

    trial: int
    state: str
    rung: int  # rungs reached: 1 is the first; 0 before it
    steps: int
    value: float | None
    run: str | None


class Best(BaseModel):
    """The best finished trial: its settings, objective, run and checkpoint."""

    model_config = ConfigDict(frozen=True)

    trial: int
    params: TrialValues
    value: float
    run: str | None
    checkpoint_uri: str | None
    run_id: str | None  # the trial's MLflow run


class BestTrial(Best):
    """The best trial as the pipeline starts from it: with its sweep, corpus and sweep's MLflow run."""

    sweep_id: str
    manifest_uri: str | None
    sweep_run_id: str | None

    def lineage(self) -> dict[str, str]:
        """The ids a model version trained from this trial carries back to the sweep."""
        return {
            "sweep_id": self.sweep_id,
            "sweep_trial": str(self.trial),
            "pretrain_run": str(self.run),
            **({"pretrain_run_id": self.run_id} if self.run_id else {}),
            **({"sweep_run_id": self.sweep_run_id} if self.sweep_run_id else {}),
        }


class SweepResult(BaseModel):
    """A sweep where it stands: the best finished trial, every trial, the steps really trained, and
    (from the flow) the sweep's MLflow parent run."""

    model_config = ConfigDict(frozen=True)

    sweep_id: str
    best: Best | None
    trials: list[TrialRow]
    steps_trained: int
    mlflow_run_id: str | None = None

    def shown(self) -> dict[str, object]:
        """What ``sweep --json`` and ``sweep status --json`` print: all but the MLflow run."""
        return self.model_dump(exclude={"mlflow_run_id"})
