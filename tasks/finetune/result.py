"""The fine-tuning stage's result: the job's own (``result.json``, written last by rank 0), the model
card's report, and the version registered; what the CLI prints and the pipeline records."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from tasks.transfer.result import BaselineReport, Registration


class FinetuneJobResult(BaseModel):
    """What a finished fine-tuning job wrote to its ``result.json``: the epoch chosen on dev, its test
    accuracy and where its classifier is."""

    model_config = ConfigDict(frozen=True)

    run: str
    run_id: str | None
    steps: int
    total_steps: int
    preempted: bool
    checkpoint_uri: str
    epochs: list[dict[str, Any]]  # one per epoch, as the job scored it
    best_epoch: int
    dev_accuracy: float
    threshold: float
    classifier_uri: str
    classifier_key: str
    test_accuracy: float
    test_seconds: float | None = None  # the read of test; None in results from before it was timed
    dataset: str
    checksum: str
    checkpoint_run_id: str | None
    rows: dict[str, int]


class FrozenProbe(BaseModel):
    """The transfer stage's L1 probe of the same checkpoint on the same splits, for the model card."""

    model_config = ConfigDict(frozen=True)

    test_accuracy: float
    dev_accuracy: float
    C: float
    features_precision: str


class FinetuneReport(BaseModel):
    """The model card's numbers: the fine-tuned classifier beside the frozen probe and the baseline."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    checksum: str
    checkpoint_uri: str
    test_accuracy: float
    dev_accuracy: float
    best_epoch: int
    threshold: float
    settings: dict[str, Any]  # the settings that change the weights, as the job ran them
    probe: FrozenProbe | None  # None when not compared (--no-baseline)
    baseline: BaselineReport | None

    @property
    def baseline_accuracy(self) -> float | None:
        """The TF-IDF baseline's test accuracy, or None."""
        return self.baseline.test_accuracy if self.baseline else None


class FinetuneResult(FinetuneJobResult):
    """A fine-tuning run, registered: the job's result, the model card's report, the version."""

    report: FinetuneReport
    registered: Registration
    model_uri: str
