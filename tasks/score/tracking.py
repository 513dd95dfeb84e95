"""MLflow for a scoring run: which registered version scores, and the run that records what it did."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tasks import registered
from tasks.registered import ModelNotFound
from tasks.score.scoring import ModelRef
from tasks.settings import Settings
from tasks.tracking import connect

NO_UNIT = -1  # ModelRef.unit of a classifier without a probe: its rows' sentiment_unit is NaN


def resolve_model(uri: str | None, settings: Settings) -> ModelRef:
    """The registered version ``uri`` names (default: the champion), its classifier downloaded once into
    ``<home>/cache/models/NAME-vN`` for the workers to load, read as data and checked against its
    signature (``tasks/registered.py``)."""
    from models.classifier import top_unit
    from models.serving import DEFAULT_MAX_TEXT_CHARS, MAX_TEXT_CHARS_KEY

    if uri is not None and not registered.MODEL_URI.match(uri):
        raise ModelNotFound(
            f"{uri!r} names no registered version: write models:/NAME@ALIAS or models:/NAME/VERSION"
        )
    found = registered.resolve(uri, settings)
    assert found.name is not None and found.version is not None and found.run_id is not None
    registered.check_folder(found.folder, found.uri)
    info = json.loads((found.folder / "classifier.json").read_text())
    import numpy as np

    with np.load(found.folder / "classifier.npz", allow_pickle=False) as arrays:
        # A fine-tuned classifier (tasks/finetune/) has no probe, so no sentiment unit: -1.
        unit = top_unit(arrays["probe.coef"]) if "probe.coef" in arrays.files else NO_UNIT
    return ModelRef(
        uri=found.uri,
        name=found.name,
        version=found.version,
        run_id=found.run_id,
        folder=str(found.folder),
        unit=unit,
        max_text_chars=int(info.get(MAX_TEXT_CHARS_KEY, DEFAULT_MAX_TEXT_CHARS)),
        weights_sha256=hashlib.sha256((found.folder / "classifier.npz").read_bytes()).hexdigest(),
    )


def log_scoring(
    settings: Settings, manifest: dict[str, Any], manifest_uri: str, tags: dict[str, str] | None = None
) -> str:
    """One MLflow run for the scoring run, a child of the run that logged the model version: rows/s,
    rejected rows, the label distribution, and a histogram of P(positive) as a PNG."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    experiment_id = connect(settings).experiment_id
    model = manifest["model"]
    tags = {
        **(tags or {}),
        "model_uri": model["uri"],
        "model_name": model["name"],
        "model_version": str(model["version"]),
        "scoring_id": manifest["scoring_id"],
        "output": manifest["output"],
    }
    if model.get("run_id"):
        try:
            experiment_id = MlflowClient().get_run(model["run_id"]).info.experiment_id
            tags["mlflow.parentRunId"] = model["run_id"]
        except MlflowException:
            pass  # logged on another tracking server: a run of its own here
    seconds = max(manifest["seconds"], 1e-9)
    rows = manifest["rows_out"]
    with mlflow.start_run(
        experiment_id=experiment_id, run_name=f"score {manifest['scoring_id']}", tags=tags
    ) as run:
        mlflow.log_params(
            {
                "model_uri": model["uri"],
                "model_version": model["version"],
                "text_column": manifest["text_column"],
                "id_columns": ",".join(manifest["id_columns"]) or "-",
                "inputs": len(manifest["inputs"]),
            }
        )
        metrics = {
            "rows_in": manifest["rows_in"],
            "rows_out": rows,
            "rejected_rows": manifest["rejected"]["rows"],
            "rows_per_s": manifest["pieces"]["rows_scored"] / seconds,
            "chars_per_s": manifest["pieces"]["chars_scored"] / seconds,
            "pieces_skipped": manifest["pieces"]["skipped"],
            "seconds": seconds,
        }
        for label, count in manifest["labels"].items():
            metrics[f"label_{label}"] = count
            metrics[f"label_{label}_fraction"] = count / rows if rows else 0.0
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        mlflow.log_dict(manifest, "manifest.json")
        mlflow.log_figure(histogram_figure(manifest), "probability_histogram.png")
        mlflow.set_tag("manifest_uri", manifest_uri)
    return str(run.info.run_id)


def histogram_figure(manifest: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = manifest["histogram"]["counts"]
    edges = [i / len(counts) for i in range(len(counts) + 1)]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.stairs(counts, edges, fill=True)
    axes.set_xlabel("P(positive)")
    axes.set_ylabel("rows")
    axes.set_title(
        f"{manifest['model']['name']} v{manifest['model']['version']}: {manifest['rows_out']:,} rows"
    )
    figure.tight_layout()
    plt.close(figure)
    return figure
