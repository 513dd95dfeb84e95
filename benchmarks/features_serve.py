"""The served model's latency, the serving rows of ``benchmarks/features.py``.

A ``SentimentClassifier`` with random weights is logged to a temporary MLflow store, served by
``mlflow models serve`` (``served_model``) and timed over HTTP (``time_requests``), once per request
size and precision (``serve_rows``). MLflow and httpx are imported only when a row is served, so
``--no-serve`` runs (the GPU check's) never load them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import say  # the working tree on the path
from features_texts import take

from models.mlstm import MLSTM, preset

SERVE_TIMEOUT_S = 300  # for the server to answer /ping: it imports MLflow and torch, loads the model


@dataclass
class ServeRow:
    preset: str
    batch: int  # texts per request
    requests: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    per_text_ms: float  # p50 ÷ batch
    device: str = "cpu"  # models/serving.py loads the classifier on the CPU
    precision: str = "auto"  # the requests' precision parameter (auto: none sent)
    latencies_ms: list[float] = field(default_factory=list)


@contextlib.contextmanager
def served_model(name: str, scratch: Path) -> Iterator[str]:
    """Log a random-weight classifier of the preset to a temporary store, serve it; yields its base URL."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow
    from mlflow.tracking import MlflowClient

    from models.classifier import SentimentClassifier
    from tasks.transfer.registry import log_classifier

    tracking_uri = f"sqlite:///{scratch}/mlflow.db"
    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri)
    experiment_id = client.create_experiment(
        "features-benchmark", artifact_location=(scratch / "artifacts").as_uri()
    )
    run_id = client.create_run(experiment_id, run_name=f"serve-{name}").info.run_id
    torch.manual_seed(0)
    model = MLSTM(preset(name))
    coef_H = np.random.default_rng(0).normal(0, model.config.hidden_size**-0.5, model.config.hidden_size)
    classifier = SentimentClassifier(model, coef_H, 0.0, {"benchmark": "random weights"})
    say(f"serving: logging a {name} classifier (random weights) to {tracking_uri} …")
    model_uri = log_classifier(run_id, classifier, "classifier")
    client.set_terminated(run_id)
    del classifier, model

    from tasks.transfer.serve import served

    say(f"serving: mlflow models serve -m {model_uri} --env-manager local --workers 1")
    with served(model_uri, tracking_uri, log=scratch / "server.log", timeout=SERVE_TIMEOUT_S) as url:
        yield url


def time_requests(
    url: str, texts: list[str], requests: int, warmup: int, precision: str = "auto"
) -> list[float]:
    """Milliseconds of each timed POST /invocations of these texts (one request each time), the model read
    in ``precision`` (auto: the served model's default, no parameter sent)."""
    import httpx

    body: dict[str, Any] = {"dataframe_records": [{"text": text} for text in texts]}
    if precision != "auto":
        body["params"] = {"precision": precision}
    latencies = []
    with httpx.Client(timeout=600) as client:
        for i in range(warmup + requests):
            started = time.perf_counter()
            response = client.post(f"{url}/invocations", json=body)
            elapsed = time.perf_counter() - started
            if response.status_code != 200:
                raise RuntimeError(f"POST /invocations: {response.status_code} {response.text[:500]}")
            predictions = response.json()["predictions"]
            if len(predictions) != len(texts):
                raise RuntimeError(
                    f"POST /invocations: {len(predictions)} predictions for {len(texts)} texts"
                )
            if i >= warmup:
                latencies.append(elapsed * 1000)
    return latencies


def serve_rows(args: argparse.Namespace, pool: list[str]) -> list[ServeRow]:
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="mlstm-bench-serve-") as scratch,
        served_model(args.serve_preset, Path(scratch)) as url,
    ):
        for precision in args.precisions:
            for batch in (1, args.serve_batch):
                say(
                    f"serving: {args.requests} requests of {batch} text(s) in {precision}, "
                    f"after {args.warmup_requests} warm-up …"
                )
                latencies = time_requests(
                    url, take(pool, batch), args.requests, args.warmup_requests, precision
                )
                p50, p99 = (float(v) for v in np.percentile(latencies, [50, 99]))
                rows.append(
                    ServeRow(
                        preset=args.serve_preset,
                        batch=batch,
                        requests=args.requests,
                        p50_ms=p50,
                        p99_ms=p99,
                        mean_ms=float(np.mean(latencies)),
                        per_text_ms=p50 / batch,
                        precision=precision,
                        latencies_ms=latencies,
                    )
                )
    return rows
