"""The corpus stage in MLflow: a built corpus's settings, counts and manifest as one run."""

from __future__ import annotations

from tasks.corpus.manifest import Manifest
from tasks.settings import Settings
from tasks.tracking import mlflow_run


def log_corpus(
    settings: Settings,
    manifest: Manifest,
    manifest_uri: str,
    seconds: float,
    tags: dict[str, str] | None = None,
) -> str:
    """Log a built corpus: its settings, counts and manifest. Returns the MLflow run id."""
    import mlflow

    tags = {
        "stage": "corpus",
        "corpus_id": manifest.corpus_id,
        "manifest_uri": manifest_uri,
        **(tags or {}),
    }
    with mlflow_run(settings, run_name=f"corpus-{manifest.corpus_id}", tags=tags) as run:
        config = manifest.config
        mlflow.log_params(
            {
                "split": ":".join(map(str, config.split)),
                "shard_mb": config.shard_mb,
                "bucket_mb": config.bucket_mb,
                "cleaning": manifest.cleaning.name,
                "num_sources": len(manifest.sources),
            }
        )
        metrics = {f"records_{k}": float(v) for k, v in manifest.totals.model_dump().items()}
        for split, info in manifest.splits.items():
            metrics[f"{split}_rows"] = float(info.rows)
            metrics[f"{split}_text_bytes"] = float(info.text_bytes)
        metrics["build_seconds"] = seconds
        mlflow.log_metrics(metrics)
        mlflow.log_text(manifest.to_json().decode(), "manifest.json")
        return str(run.info.run_id)
