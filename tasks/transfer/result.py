"""The transfer stage's result: each dataset's probe, the registered version, and the MLflow run; what
the CLI prints, the pipeline records and reads back, and fine-tuning's registration shares."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class SplitFeatures(BaseModel):
    """One split's features in the store: where, how many rows, and whether the cache had them."""

    model_config = ConfigDict(frozen=True)

    uri: str
    rows: int
    cached: bool


class Extracted(BaseModel):
    """One dataset's features, computed or found in the cache: what the probe step reads (URIs, not
    data), with the dataset and checkpoint they came from."""

    model_config = ConfigDict(frozen=True)

    name: str
    spec: str  # NAME=PATH as given
    source: str
    kind: str
    checksum: str  # of the dataset's content
    dev_from_train: str | None  # how dev was cut from train, when the dataset has no dev split
    checkpoint_uri: str
    checkpoint_run_id: str | None
    weights: str  # the weights' fingerprint: the features' cache key
    hidden_size: int
    features_precision: str  # what the features were read in here (auto's answer on this device)
    splits: dict[str, SplitFeatures]


class BaselineReport(BaseModel):
    """The TF-IDF baseline on a dataset's own splits, measured or read from the store's cache."""

    model_config = ConfigDict(frozen=True)

    test_accuracy: float
    dev_accuracy: float
    C: float
    seconds: float
    method: str
    cached: bool


class SweepRecord(BaseModel):
    """One C of a probe's sweep, as the report keeps it."""

    model_config = ConfigDict(frozen=True)

    C: float
    dev_accuracy: float
    nonzero: int
    objective: float  # NaN where the solver does not measure it
    seconds: float
    converged: bool


class Heatmap(BaseModel):
    """The sentiment unit read byte by byte over one test review: which, why shown, and its picture."""

    model_config = ConfigDict(frozen=True)

    role: str
    row: int
    label: int
    probability: float  # the classifier's P(positive) after the whole review
    uri: str


class DatasetSummary(BaseModel):
    """A dataset's headline numbers (``transfer --json`` prints one per dataset)."""

    model_config = ConfigDict(frozen=True)

    test_accuracy: float
    dev_accuracy: float
    C: float
    nonzero: int
    top_unit: int
    top_unit_accuracy: float
    baseline_test_accuracy: float | None  # None when the TF-IDF baseline was not measured


class ProbeReport(BaseModel):
    """One dataset's probe, as its ``report.json`` holds it (and ``report_uri``, where that is)."""

    model_config = ConfigDict(frozen=True)

    name: str
    spec: str
    source: str
    kind: str
    checksum: str
    checkpoint_uri: str
    dev_from_train: str | None
    features_precision: str
    rows: dict[str, int]  # per split
    test_accuracy: float
    dev_accuracy: float
    C: float
    nonzero: int
    top_unit: int
    top_unit_accuracy: float
    top_unit_sign: int  # +1 if a high activation means positive
    sweep: list[SweepRecord]
    reference: dict[str, float]  # the papers' cited accuracy on this dataset, where there is one
    baseline: BaselineReport | None  # None when not measured (--no-baseline)
    probe_uri: str
    plots: dict[str, str]  # file name → URI
    heatmaps: list[Heatmap]
    report_uri: str | None = None

    @property
    def baseline_accuracy(self) -> float | None:
        """The measured baseline's test accuracy, or None."""
        return self.baseline.test_accuracy if self.baseline else None

    def summary(self) -> DatasetSummary:
        return DatasetSummary(
            test_accuracy=self.test_accuracy, dev_accuracy=self.dev_accuracy, C=self.C, nonzero=self.nonzero,
            top_unit=self.top_unit, top_unit_accuracy=self.top_unit_accuracy,
            baseline_test_accuracy=self.baseline_accuracy,
        )  # fmt: skip


class Registrable(Protocol):
    """What registering a classifier reads of its report (a probe's or a fine-tuning's)."""

    @property
    def name(self) -> str: ...
    @property
    def checksum(self) -> str: ...
    @property
    def checkpoint_uri(self) -> str: ...
    @property
    def test_accuracy(self) -> float: ...
    @property
    def baseline_accuracy(self) -> float | None: ...


class Registration(BaseModel):
    """A version registered in MLflow and the champion rule's verdict on it."""

    model_config = ConfigDict(frozen=True)

    name: str
    version: int
    model_uri: str
    champion_version: int | None = None  # the champion it was measured against; absent when none
    promoted: bool
    reason: str
    champion_accuracy: float | None
    champion_uri: str

    @model_serializer(mode="wrap")
    def _without_absent_champion(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        if shown.get("champion_version") is None:
            shown.pop("champion_version", None)
        return shown


class TransferResult(BaseModel):
    """A transfer run: its MLflow run, each dataset's summary and report, the version it registered."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    datasets: dict[str, DatasetSummary]
    reports: list[ProbeReport]
    registered: Registration | None

    @classmethod
    def of(cls, run_id: str, reports: list[ProbeReport], registered: Registration | None) -> TransferResult:
        return cls(
            run_id=run_id,
            datasets={report.name: report.summary() for report in reports},
            reports=reports,
            registered=registered,
        )
