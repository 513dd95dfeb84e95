"""MLflow for the transfer stage: the run, what it records, the served model, and who is champion.

The classifier is logged as an MLflow pyfunc whose loader is the installed package's
``models/mlflow_loader.py`` and whose data is the classifier's ``.npz`` of weights and its settings:
nothing is pickled, and no code is stored with the model. A new
version becomes ``@champion`` only when its test accuracy beats the champion's on the same test set:
read from the champion's tags when it was scored on the same data, else measured by running it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from models import mlflow_loader
from models.classifier import LABELS, SentimentClassifier
from models.finetuned import FinetunedClassifier
from models.mlflow_loader import VERSION_KEY, installed_version
from models.serving import MAX_TEXT_CHARS_KEY
from tasks.registered import sign_folder
from tasks.settings import Settings, get_settings
from tasks.store import split_object_uri
from tasks.tracking import connect
from tasks.transfer.result import ProbeReport, Registrable, Registration
from tasks.transfer.stage import REFERENCE_SOURCE, accuracy_beside_baseline

CHAMPION = "champion"
EXAMPLE_TEXTS = ["A warm, funny and beautifully acted film.", "Dull, predictable and far too long."]
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def open_transfer_run(
    parent_run_id: str | None, settings: Settings, *, run_name: str, tags: dict[str, str]
) -> str:
    """A run for this transfer: a child of the run that trained the checkpoint, when this server has it."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    experiment_id = connect(settings).experiment_id
    client = MlflowClient()
    if parent_run_id:
        try:
            experiment_id = client.get_run(parent_run_id).info.experiment_id
            tags = {**tags, "mlflow.parentRunId": parent_run_id}
        except MlflowException:
            pass  # trained against another tracking server: a run of its own here
    return str(client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id)


def log_report(run_id: str, report: ProbeReport, settings: Settings) -> None:
    """One dataset's probe under the run: inputs, params, metrics, the sweep, plots and the report."""
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, Schema

    name = report.name
    schema = Schema([ColSpec("string", "text"), ColSpec("long", "label")])
    with warnings.catch_warnings():
        # Two of MLflow's local-file source types claim a path; either records it the same way.
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
        source = resolve_dataset_source(report.source)
    with mlflow.start_run(run_id=run_id):
        for split, context in (("train", "training"), ("dev", "validation"), ("test", "testing")):
            # MLflow's own docs make MetaDataset so; its stubs mark `profile` abstract.
            dataset = MetaDataset(  # type: ignore[abstract]
                source, name=f"{name}-{split}", digest=report.checksum[:16], schema=schema
            )
            mlflow.log_input(dataset, context=context, tags={"rows": str(report.rows[split])})
        mlflow.log_params(
            {f"{name}.kind": report.kind, f"{name}.checksum": report.checksum}
            | {f"{name}.C": report.C, f"{name}.top_unit": report.top_unit}
            | {f"{name}.dev_from_train": report.dev_from_train or "-"}
            | {f"{name}.features_precision": report.features_precision}
        )
        metrics = {
            f"{name}_test_accuracy": report.test_accuracy,
            f"{name}_dev_accuracy": report.dev_accuracy,
            f"{name}_nonzero": float(report.nonzero),
            f"{name}_top_unit_accuracy": report.top_unit_accuracy,
        }
        if (baseline := report.baseline) is not None:  # the TF-IDF baseline, measured on the same splits
            metrics |= {f"{name}_baseline_test_accuracy": baseline.test_accuracy}
            metrics |= {f"{name}_baseline_dev_accuracy": baseline.dev_accuracy}
            metrics[f"{name}_vs_baseline"] = report.test_accuracy - baseline.test_accuracy
            mlflow.log_param(f"{name}.baseline_C", baseline.C)
        mlflow.log_metrics(metrics)
        for step, point in enumerate(report.sweep):
            mlflow.log_metrics(
                {f"{name}_sweep_dev_accuracy": point.dev_accuracy, f"{name}_sweep_nonzero": point.nonzero},
                step=step,
            )
        mlflow.log_dict(report.model_dump(), f"{name}/report.json")
        for uri in report.plots.values():
            store, key = split_object_uri(uri, endpoint_url=settings.s3_endpoint_url)
            with store.local_copy(key) as path:
                mlflow.log_artifact(str(path), artifact_path=name)
        for heatmap in report.heatmaps:  # the sentiment neuron over six to eight test reviews
            store, key = split_object_uri(heatmap.uri, endpoint_url=settings.s3_endpoint_url)
            with store.local_copy(key) as path:
                mlflow.log_artifact(str(path), artifact_path=f"{name}/neuron")


def heatmaps_markdown(reports: list[ProbeReport], link: Callable[[str], str]) -> str:
    """Per dataset, a list of the neuron's heatmaps: why each review was picked, its label and P, and
    ``link(artifact_path)`` to the PNG in the MLflow run."""
    lines = []
    for report in reports:
        if not report.heatmaps:
            continue
        lines += [
            "",
            f"Unit {report.top_unit} over {len(report.heatmaps)} {report.name} test reviews (the "
            "three most positive, the three most negative, the two most confidently misclassified):",
            "",
        ]
        for h in report.heatmaps:
            path = f"{report.name}/neuron/{h.uri.rsplit('/', 1)[-1]}"
            label = "positive" if h.label == 1 else "negative"
            lines.append(
                f"- {h.role}: test row {h.row}, labelled {label}, P(positive) {h.probability:.3f}: {link(path)}"
            )
    return "\n".join(lines) + ("\n" if lines else "")


def pip_requirements() -> list[str]:
    """What serving the model needs, pinned to what made it. A CPU build of torch is found on its index."""
    import mlflow
    import numpy
    import pandas
    import torch

    requirements = [
        f"mlflow=={mlflow.__version__}",
        f"torch=={torch.__version__}",
        f"numpy=={numpy.__version__}",
        f"pandas=={pandas.__version__}",
    ]
    if "+cpu" in torch.__version__:
        requirements.insert(0, f"--extra-index-url {PYTORCH_CPU_INDEX}")
    return requirements


def log_classifier(
    run_id: str,
    classifier: SentimentClassifier | FinetunedClassifier,
    name: str,
    *,
    max_text_chars: int | None = None,
) -> str:
    """Log the classifier (a probe, or a fine-tuned model) as a pyfunc under the run; returns its model
    URI. The served copy refuses texts longer than ``max_text_chars`` (default: MLSTM_MAX_TEXT_CHARS)."""
    import mlflow
    import pandas as pd
    from mlflow.models import infer_signature

    example = pd.DataFrame({"text": EXAMPLE_TEXTS})
    output = pd.DataFrame({"label": list(LABELS[::-1]), "probability": [0.9, 0.1]})
    signature = infer_signature(example, output, params={"batch_size": 64, "precision": "auto"})
    with tempfile.TemporaryDirectory(prefix="mlstm-classifier-") as scratch, mlflow.start_run(run_id=run_id):
        limit = max_text_chars or get_settings().max_text_chars
        logged_by = installed_version()
        limited = dataclasses.replace(
            classifier, info={**classifier.info, MAX_TEXT_CHARS_KEY: limit, VERSION_KEY: logged_by}
        )
        folder = limited.save(Path(scratch) / "classifier")
        sign_folder(folder)  # the project's readers refuse changed files
        info = mlflow.pyfunc.log_model(
            name=name,
            loader_module=mlflow_loader.__name__,
            data_path=str(folder),
            metadata={VERSION_KEY: logged_by},
            signature=signature,
            input_example=example,
            pip_requirements=pip_requirements(),
        )
    return str(info.model_uri)


def register(
    model_uri: str,
    report: Registrable,
    settings: Settings,
    *,
    score_on_test: Callable[[str], float],
    lineage: dict[str, str] | None = None,
    description: str,
) -> Registration:
    """Register a version; make it ``@champion`` only if it beats the champion on this test set.

    ``score_on_test(model_uri)`` measures a model's accuracy on this report's test set; it is called
    only when the champion was scored on other data (its tags then say nothing comparable). A champion
    that cannot be scored (its model unreadable) is replaced, and the reason says why.
    ``lineage`` tags lead from the version back to its corpus, pretraining run and flow runs.
    ``description``: the version's model card (a probe's: ``model_card``).
    """
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    connect(settings)
    client = MlflowClient()
    name = settings.model_name
    baseline = report.baseline_accuracy
    tags = {
        "dataset": report.name,
        "dataset_checksum": report.checksum,
        "test_accuracy": f"{report.test_accuracy:.6f}",
        **({"baseline_test_accuracy": f"{baseline:.6f}"} if baseline is not None else {}),
        **(lineage or {}),
        "checkpoint_uri": report.checkpoint_uri,
    }
    with contextlib.redirect_stderr(io.StringIO()):  # MLflow prints "Successfully registered …" there
        version = mlflow.register_model(model_uri, name, tags=tags)
    client.update_model_version(name, version.version, description=description)
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        champion = None
    champion_accuracy: float | None = None
    if champion is None:
        promoted, reason = True, "there was no champion"
    else:
        unreadable = None
        if champion.tags.get("dataset_checksum") == report.checksum:
            champion_accuracy = float(champion.tags["test_accuracy"])
        else:
            try:
                champion_accuracy = score_on_test(f"models:/{name}@{CHAMPION}")
            # Whatever stops the champion from loading (its artifacts gone, a model of an older code)
            # also stops it from serving: the new version, which was just scored, takes its place.
            except Exception as error:
                champion_accuracy, unreadable = None, f"{type(error).__name__}: {str(error).splitlines()[0]}"
        if unreadable is not None:
            promoted = True
            reason = (
                f"champion v{champion.version} could not be scored on {report.name} ({unreadable}); "
                f"v{version.version} with test accuracy {report.test_accuracy:.4f} replaces it"
            )
        elif champion_accuracy is not None:
            promoted = report.test_accuracy > champion_accuracy
            verdict = "beats" if promoted else "does not beat"
            reason = (
                f"test accuracy {report.test_accuracy:.4f} {verdict} champion v{champion.version}'s "
                f"{champion_accuracy:.4f} on {report.name}"
            )
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    client.set_model_version_tag(name, version.version, "promotion", reason)
    return Registration(
        name=name,
        version=int(version.version),
        model_uri=model_uri,
        champion_version=int(champion.version) if champion is not None else None,
        promoted=promoted,
        reason=reason,
        champion_accuracy=champion_accuracy,
        champion_uri=f"models:/{name}@{CHAMPION}",
    )


# Tags of the pretraining run that a registered model's lineage carries on, under these names.
LINEAGE_FROM_PRETRAIN = {
    "corpus_id": "corpus_id",
    "manifest_uri": "manifest_uri",
    "prefect_flow_run_id": "pretrain_prefect_flow_run_id",
}


def lineage_of(checkpoint_run_id: str | None, settings: Settings) -> dict[str, str]:
    """Where a checkpoint came from, read from the MLflow run that trained it (empty when unknown)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not checkpoint_run_id:
        return {}
    connect(settings)
    try:
        tags = MlflowClient().get_run(checkpoint_run_id).data.tags
    except MlflowException:
        return {}  # trained against another tracking server
    found = {ours: tags[theirs] for theirs, ours in LINEAGE_FROM_PRETRAIN.items() if theirs in tags}
    return {"pretrain_run_id": checkpoint_run_id, **found}


def promote(version: int, settings: Settings, *, reason: str) -> dict[str, Any]:
    """Point ``@champion`` at ``version`` by hand (a promotion, or a rollback); returns who was before."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    connect(settings)
    client = MlflowClient()
    name = settings.model_name
    try:
        client.get_model_version(name, str(version))
    except MlflowException as error:
        raise ValueError(
            f"{name} has no version {version} at {settings.shown_mlflow_tracking_uri}"
        ) from error
    try:
        previous: int | None = int(client.get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException:
        previous = None
    client.set_registered_model_alias(name, CHAMPION, str(version))
    client.set_model_version_tag(name, str(version), "promotion", reason)
    return {"name": name, "version": version, "previous": previous}


def model_card(report: ProbeReport) -> str:
    """The registered version's description (its page in the MLflow UI): the probe's test accuracy beside
    the measured baseline's, with the difference, and the paper's figure as a citation."""
    source = f" (`{report.source}`)" if report.source else ""
    lines = [
        f"L1 logistic-regression probe on the mLSTM's final cell state, trained on {report.name}{source}, "
        f"data checksum {report.checksum[:16]}, checkpoint `{report.checkpoint_uri}`.",
        "",
        f"- test accuracy {accuracy_beside_baseline(report.test_accuracy, report.baseline_accuracy)}",
        f"- dev accuracy {report.dev_accuracy:.2%} at C = {report.C:g}, {report.nonzero} non-zero "
        f"weights; unit {report.top_unit} alone: {report.top_unit_accuracy:.2%} on test",
    ]
    if (b := report.baseline) is not None:
        lines.append(
            f"- the baseline, measured on the same splits: {b.method}; dev {b.dev_accuracy:.2%} at C = {b.C:g}"
        )
    paper = report.reference.get("radford_2017_mlstm_4096")
    if paper:
        lines.append(f"- cited, not measured here: {paper:.2%} for the 4096-unit mLSTM ({REFERENCE_SOURCE})")
    return "\n".join(lines) + "\n"


def report_markdown(reports: list[ProbeReport], registered: Registration | None) -> str:
    """The probe report as markdown: ours beside the measured TF-IDF baseline and the paper's cited figure."""
    lines = [
        "| dataset | test acc | baseline (TF-IDF, measured) | probe − baseline | dev acc | C | non-zero "
        "| top unit | its acc | paper (4096, cited) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        paper = r.reference.get("radford_2017_mlstm_4096")
        baseline = r.baseline_accuracy
        measured, gap = "-", "-"
        if baseline is not None:
            measured, gap = f"{baseline:.2%}", f"{(r.test_accuracy - baseline) * 100:+.2f} points"
        lines.append(
            f"| {r.name} | {r.test_accuracy:.2%} | {measured} | {gap} | {r.dev_accuracy:.2%} | {r.C:g} | {r.nonzero} "
            f"| {r.top_unit} | {r.top_unit_accuracy:.2%} | {f'{paper:.2%}' if paper else '-'} |"
        )
    lines += ["", f"The paper's column is a citation ({REFERENCE_SOURCE}); the baseline is measured here."]
    if registered:
        lines += ["", f"Registered `{registered.name}` v{registered.version}: {registered.reason}."]
    return "\n".join(lines) + "\n"
