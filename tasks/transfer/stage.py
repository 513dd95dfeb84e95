"""The transfer stage without Prefect: features → L1 probe → MLflow → the registered classifier.

Each step takes and returns small JSON-able records that point at files in the store, so a flow can
pass them between tasks (and processes) without moving features around:

    extract(params, spec)  → ``features/<weights>/<dataset>/{train,dev,test}.arrow`` (cached)
    probe(extracted)       → ``transfer/<weights>/<dataset>/{probe.npz,report.json,*.png}``, beside the
                             measured TF-IDF baseline (``baseline/<data checksum>/<method>.json``, cached)
    record(...)            → MLflow params, metrics, inputs and plots; the pyfunc, registered
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from models.classifier import SentimentClassifier, probability
from models.features import OnBatch, default_device
from models.precision import PRECISION_NAMES, resolve_precision
from tasks.jobs.checkpoint import Checkpoint, load_checkpoint, newest_checkpoint
from tasks.settings import Settings
from tasks.store import split_object_uri, store_of
from tasks.transfer.config import TransferParams
from tasks.transfer.datasets import load_dataset
from tasks.transfer.explain import class_means, explain, pick_examples, to_png
from tasks.transfer.features import cached_features, weights_fingerprint
from tasks.transfer.precomputed import read_split
from tasks.transfer.probe import ProbeResult, fit_probe, plot_sweep, plot_top_unit
from tasks.transfer.result import BaselineReport, Extracted, ProbeReport, SplitFeatures

SPLITS = ("train", "dev", "test")
NEWEST = "newest"  # a checkpoint or corpus URI that means: the one saved last in the store
# Citations, not measurements: the test accuracy Radford et al. 2017 ("Learning to Generate Reviews and
# Discovering Sentiment", arXiv:1704.01444, Tables 1 and 3) report for the 4096-unit mLSTM's L1 probe.
# The baseline a probe is compared with is measured on the user's own splits (tasks/transfer/baseline.py).
REFERENCE = {
    "sst2": {"radford_2017_mlstm_4096": 0.918},
    "imdb": {"radford_2017_mlstm_4096": 0.9288},
}
REFERENCE_SOURCE = "Radford et al. 2017, arXiv:1704.01444"


def resolve_checkpoint(uri: str, settings: Settings) -> str:
    """``newest`` is the checkpoint saved last in the store; any other URI is itself."""
    if uri != NEWEST:
        return uri
    found = newest_checkpoint(store_of(settings))
    if found is None:
        raise ValueError(
            f"--checkpoint newest: no training run has a checkpoint in {settings.resolved_store_uri}"
        )
    return found


# The checkpoints read in the current ``checkpoints_loaded_once`` scope, by URI; None outside one.
_loaded: contextvars.ContextVar[dict[str, Checkpoint] | None] = contextvars.ContextVar("loaded", default=None)


@contextlib.contextmanager
def checkpoints_loaded_once() -> Iterator[None]:
    """Within it, each checkpoint is read from the store once and kept (a pipeline run: the transfer's
    key, each dataset's features and the registry read the same one). A step's checkpoint never changes
    once published, so a kept one is never stale; leaving the outermost scope lets it go."""
    token = _loaded.set(_loaded.get() if _loaded.get() is not None else {})  # an inner scope shares it
    try:
        yield
    finally:
        _loaded.reset(token)


def load_checkpoint_of(uri: str, settings: Settings) -> Checkpoint:
    resolved = resolve_checkpoint(uri, settings)
    loaded = _loaded.get()
    if loaded is not None and resolved in loaded:
        return loaded[resolved]
    checkpoint = load_checkpoint(resolved, endpoint_url=settings.s3_endpoint_url)
    if loaded is not None:
        loaded[resolved] = checkpoint
    return checkpoint


def extract(
    params: TransferParams,
    spec: str,
    settings: Settings,
    *,
    on_start: Callable[[int], None] | None = None,
    on_batch: OnBatch | None = None,
) -> Extracted:
    """The features of one dataset's three splits, computed or found in the store's cache.

    ``on_start`` hears the number of rows once the data is read; ``on_batch`` after every batch.
    """
    checkpoint = load_checkpoint_of(params.checkpoint, settings)
    model = checkpoint.model()
    dataset = load_dataset(spec, text_column=params.text_column, label_column=params.label_column)
    if on_start is not None:
        on_start(sum(len(split.texts) for split in dataset.splits().values()))
    store = store_of(settings)
    weights = weights_fingerprint(model)  # hashes every weight: once, not once per split
    splits = {}
    for split, data in dataset.splits().items():
        found = cached_features(
            store,
            model,
            data.texts,
            data_checksum=dataset.checksum[:16],
            name=split,
            columns={"label": data.labels},
            weights=weights,
            batch_size=params.batch_size,
            on_batch=on_batch,
            precision=params.precision,
        )
        splits[split] = SplitFeatures(uri=found.uri, rows=len(data.texts), cached=found.cached)
    return Extracted(
        name=dataset.name,
        spec=spec,
        source=dataset.source,
        kind=dataset.kind,
        checksum=dataset.checksum,
        dev_from_train=dataset.dev_from_train,
        checkpoint_uri=checkpoint.uri,
        checkpoint_run_id=checkpoint.meta.get("mlflow_run_id"),
        weights=weights,
        hidden_size=model.config.hidden_size,
        features_precision=PRECISION_NAMES[resolve_precision(params.precision, default_device())],
        splits=splits,
    )


def split_features(extracted: Extracted, settings: Settings) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each split's features and labels, as ``extract`` wrote them (the `probe` command's reader:
    memory-mapped, and every error names the file and the column)."""
    return {
        split: read_split(extracted.splits[split].uri, endpoint_url=settings.s3_endpoint_url)
        for split in SPLITS
    }


def probe(
    extracted: Extracted,
    params: TransferParams,
    settings: Settings,
    *,
    on_fit: Callable[[Any], None] | None = None,
) -> ProbeReport:
    """Fit the L1 probe on one dataset's features; write its weights, report and plots to the store."""
    data = split_features(extracted, settings)
    result = fit_probe(
        *data["train"], *data["dev"], *data["test"], Cs=params.Cs, seed=params.seed, on_fit=on_fit,
        solver=params.solver, device=_probe_device(params.solver),
    )  # fmt: skip
    store = store_of(settings)
    measured = (
        measure_baseline(extracted.spec, extracted.checksum, params, settings) if params.baseline else None
    )
    prefix = f"transfer/{extracted.weights}/{extracted.checksum[:16]}"
    with tempfile.TemporaryDirectory(prefix="mlstm-probe-") as scratch:
        np.savez(
            Path(scratch) / "probe.npz",
            coef=result.coef,
            intercept=np.array([result.intercept], dtype=np.float32),
            class_means=class_means(*data["train"]),  # where `generate --sentiment` holds a unit
        )
        store.put_file(Path(scratch) / "probe.npz", f"{prefix}/probe.npz")
        plots = {}
        for name, figure in _figures(result, extracted.name, *data["test"]).items():
            figure.savefig(Path(scratch) / name, dpi=110, bbox_inches="tight")
            store.put_file(Path(scratch) / name, f"{prefix}/{name}")
            plots[name] = store.url(f"{prefix}/{name}")
        heatmaps = _neuron_heatmaps(extracted, params, settings, result, data["test"], Path(scratch))
        for heatmap in heatmaps:
            key = f"{prefix}/{heatmap['file']}"
            store.put_file(Path(scratch) / heatmap.pop("file"), key)
            heatmap["uri"] = store.url(key)
    report = {
        **extracted.model_dump(
            include={
                "name",
                "spec",
                "source",
                "kind",
                "checksum",
                "checkpoint_uri",
                "dev_from_train",
                "features_precision",
            }
        ),
        "rows": {split: extracted.splits[split].rows for split in SPLITS},
        **result.summary(),
        "top_unit_sign": result.top_unit_sign,
        "sweep": [asdict(point) for point in result.sweep],
        "reference": REFERENCE.get(extracted.name, {}),
        "baseline": measured.model_dump() if measured else None,
        "probe_uri": store.url(f"{prefix}/probe.npz"),
        "plots": plots,
        "heatmaps": heatmaps,
    }
    # report.json: the report as it was written before it was a model (the same keys, in their order).
    store.write_bytes(f"{prefix}/report.json", json.dumps(report, indent=2).encode())
    return ProbeReport.model_validate({**report, "report_uri": store.url(f"{prefix}/report.json")})


def measure_baseline(spec: str, checksum: str, params: TransferParams, settings: Settings) -> BaselineReport:
    """The TF-IDF baseline on the splits of dataset ``spec`` (whose content is ``checksum``), read from
    the store when this data was measured by this method before."""
    from tasks.transfer.baseline import METHOD, fit_baseline

    store = store_of(settings)
    # The same file read with other columns is other data: the columns are part of the key.
    columns = f"{params.text_column}\0{params.label_column}"
    method = hashlib.sha256(f"{METHOD}\0{columns}".encode()).hexdigest()[:12]
    key = f"baseline/{checksum[:16]}/{method}.json"
    if store.exists(key):
        return BaselineReport.model_validate({**json.loads(store.read_bytes(key)), "cached": True})
    dataset = load_dataset(spec, text_column=params.text_column, label_column=params.label_column)
    if dataset.checksum != checksum:
        raise ValueError(f"{dataset.source} changed while the transfer stage read it; run it again")
    measured = {**fit_baseline(dataset).as_dict(), "method": METHOD}
    store.write_bytes(key, json.dumps(measured, indent=2).encode())
    return BaselineReport.model_validate({**measured, "cached": False})


def _neuron_heatmaps(
    extracted: Extracted,
    params: TransferParams,
    settings: Settings,
    result: ProbeResult,
    test: tuple[np.ndarray, np.ndarray],
    scratch: Path,
) -> list[dict[str, Any]]:
    """The top unit read byte by byte over six to eight test reviews (``pick_examples``: the three most
    positive, the three most negative, the two most confidently misclassified), one PNG each in
    ``scratch``; returns what each shows. Only those reviews are read again, not the test set."""
    test_X, test_y = test
    p_N = probability(test_X, result.coef, result.intercept)
    examples = pick_examples(p_N, test_y)
    texts = load_dataset(
        extracted.spec, text_column=params.text_column, label_column=params.label_column
    ).test.texts
    model = load_checkpoint_of(extracted.checkpoint_uri, settings).model()
    classifier = SentimentClassifier(model, result.coef, result.intercept)
    shown = []
    for example in examples:
        reading = explain(classifier, texts[example.index], unit=result.top_unit)
        label = "positive" if test_y[example.index] == 1 else "negative"
        title = f"{extracted.name} test row {example.index} ({label}): P(positive) = {reading.final:.3f}"
        to_png(reading, scratch / f"neuron-{example.file}", title=title)
        shown.append(
            {
                "role": example.role,
                "row": example.index,
                "label": int(test_y[example.index]),
                "probability": reading.final,
                "file": f"neuron-{example.file}",
            }
        )
    return shown


def _probe_device(solver: str) -> str:
    import torch

    return "cuda" if solver == "newton" and torch.cuda.is_available() else "cpu"


def _figures(result: ProbeResult, name: str, test_X: np.ndarray, test_y: np.ndarray) -> dict[str, Any]:
    return {
        "accuracy_vs_C.png": plot_sweep(result, f"{name}: L1 logistic regression on mLSTM features"),
        "top_unit.png": plot_top_unit(
            result, test_X, test_y, f"{name}: unit {result.top_unit} on the test set, by class"
        ),
    }


def classifier_of(report: ProbeReport, settings: Settings) -> SentimentClassifier:
    """The featurizer of the report's checkpoint with its probe on top."""
    model = load_checkpoint_of(report.checkpoint_uri, settings).model()
    store, key = split_object_uri(report.probe_uri, endpoint_url=settings.s3_endpoint_url)
    with store.local_copy(key) as path, np.load(path, allow_pickle=False) as arrays:
        coef_H, intercept = arrays["coef"], float(arrays["intercept"][0])
        class_means_2H = arrays["class_means"] if "class_means" in arrays.files else None
    info = {
        "dataset": report.name,
        "checksum": report.checksum,
        "checkpoint_uri": report.checkpoint_uri,
        "C": report.C,
        "test_accuracy": report.test_accuracy,
    }
    return SentimentClassifier(model, coef_H, intercept, info, class_means_2H)


def accuracy_beside_baseline(test_accuracy: float, baseline: float | None) -> str:
    """``82.10% vs baseline 80.00% (+2.10 points)``: a probe's test accuracy beside the baseline's."""
    if baseline is None:
        return f"{test_accuracy:.2%} (no baseline measured)"
    return f"{test_accuracy:.2%} vs baseline {baseline:.2%} ({(test_accuracy - baseline) * 100:+.2f} points)"


def accuracy_on_test(model_uri: str, spec: str, params: TransferParams) -> float:
    """Accuracy of any registered classifier (a champion, say) on a dataset's test split."""
    import pandas as pd

    from tasks import registered
    from tasks.settings import get_settings

    test = load_dataset(spec, text_column=params.text_column, label_column=params.label_column).test
    # Read as data and built by this package: never MLflow's flavour dispatch (tasks/registered.py).
    model = registered.load(registered.resolve(model_uri, get_settings()))
    predicted = model.predict(pd.DataFrame({"text": test.texts}))
    return float(((predicted["probability"].to_numpy() >= 0.5) == test.labels).mean())
