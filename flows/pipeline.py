"""The pipeline flow: corpus → pretrain → transfer → register, as subflows under one MLflow parent run.

Each stage is skipped when its inputs have not changed (see ``tasks/pipeline.py`` for the keys), so a
scheduled run that finds nothing new costs seconds. The registered model version carries lineage
tags back to its corpus manifest, its training run and checkpoint, and every Prefect flow run.
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.states import State

from flows import names, progress
from flows.corpus import build_corpus
from flows.pretrain import pretrain
from flows.runtime import task_runner
from flows.transfer import transfer
from tasks.corpus.build import plan_corpus, read_manifest, summary_of
from tasks.pipeline import (
    PipelineParams,
    close_pipeline_run,
    finished_run,
    open_pipeline_run,
    pretrain_params,
    pretrain_run_name,
    transfer_key,
    transfer_params,
    transfer_record_key,
)
from tasks.pretrain.stage import job_result, plan_job, read_corpus_manifest, resolve_corpus
from tasks.settings import Settings, get_settings
from tasks.store import store_of
from tasks.sweep.engine import best_trial
from tasks.tracking import find_run, model_link, run_link
from tasks.transfer.stage import resolve_checkpoint, versus_baseline


@task(name="fingerprint sources", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def corpus_key(params: PipelineParams) -> dict[str, str]:
    """The corpus id of the sources as they are now (fingerprints are cached by size and mtime)."""
    settings = get_settings()
    plan = plan_corpus(
        params.sources,
        params.corpus,
        s3_endpoint_url=settings.s3_endpoint_url,
        cache_path=settings.home / "cache" / "fingerprints.json",
    )
    return {"corpus_id": plan.corpus_id, "manifest_key": plan.manifest_key}


@task(name="hash checkpoint and datasets", cache_policy=NO_CACHE)
def transfer_key_task(checkpoint_uri: str, params: PipelineParams) -> str:
    """The transfer's key: the weights' and the datasets' content, and the probe's settings."""
    return transfer_key(transfer_params(params.transfer, checkpoint_uri), get_settings())


def _flow_run_id_of(state: State) -> str:
    return str(state.state_details.flow_run_id or "")


def _skipped(stage: str) -> None:
    get_run_logger().info("%s: inputs unchanged, skipped (force it with --force %s)", stage, stage)
    sink = progress.current()
    sink.stage(f"{stage}: unchanged", total=1)
    sink.advance(1)


@flow(name="pipeline", flow_run_name=names.pipeline_name, log_prints=True)
def pipeline(params: PipelineParams) -> dict[str, Any]:
    """Raw reviews to a registered, promoted sentiment classifier; stages with unchanged inputs skip."""
    settings = get_settings()
    flow_run = get_run_context().flow_run  # type: ignore[union-attr]
    flow_run_id = str(flow_run.id) if flow_run else ""
    run_id = open_pipeline_run(settings, params, {"prefect_flow_run_id": flow_run_id})
    # Each stage's record fills in as it goes: state, key, MLflow run, Prefect flow run.
    stages: dict[str, dict[str, Any]] = {stage: {} for stage in params.stages}
    lineage = {"pipeline_run_id": run_id, "pipeline_prefect_flow_run_id": flow_run_id}
    metrics: dict[str, float] = {}
    result: dict[str, Any] = {"run_id": run_id, "stages": stages}
    get_run_logger().info(
        "stages %s (forced: %s); MLflow parent run %s at %s",
        ", ".join(params.stages), ", ".join(params.force) or "none", run_id, settings.resolved_mlflow_tracking_uri,
    )  # fmt: skip
    try:
        manifest_uri = resolve_corpus(params.manifest_uri, settings) if params.manifest_uri else None
        if "corpus" in params.stages:
            result["corpus"] = _corpus(params, settings, run_id, stages["corpus"])
            manifest_uri = result["corpus"]["manifest_uri"]
            metrics["corpus_rows"] = float(result["corpus"]["rows"])
        checkpoint_uri = (
            resolve_checkpoint(params.checkpoint_uri, settings) if params.checkpoint_uri else None
        )
        if params.from_sweep:
            best = best_trial(params.from_sweep, settings)
            checkpoint_uri = best["checkpoint_uri"]
            manifest_uri = manifest_uri or best["manifest_uri"]
            lineage.update(
                sweep_id=params.from_sweep,
                sweep_trial=str(best["trial"]),
                pretrain_run=str(best["run"]),
                **({"pretrain_run_id": best["run_id"]} if best.get("run_id") else {}),
                **({"sweep_run_id": best["sweep_run_id"]} if best.get("sweep_run_id") else {}),
            )
            get_run_logger().info(
                "from sweep %s: trial %s (%s), val bpc %.4f",
                params.from_sweep,
                best["trial"],
                best["run"],
                best["value"],
            )
        if "pretrain" in params.stages:
            assert manifest_uri is not None  # PipelineParams checks it
            result["pretrain"] = _pretrain(params, settings, manifest_uri, run_id, stages["pretrain"])
            checkpoint_uri = result["pretrain"]["checkpoint_uri"]
            metrics.update(
                {k: float(result["pretrain"][k]) for k in ("final_loss", "val_bpc") if result["pretrain"][k]}
            )
        for stage, info in stages.items():
            lineage.update({f"{stage}_run_id": info["run_id"]} if info.get("run_id") else {})
            lineage.update(
                {f"{stage}_prefect_flow_run_id": info["flow_run_id"]} if info.get("flow_run_id") else {}
            )
        if manifest_uri:
            lineage["manifest_uri"] = manifest_uri
        if "transfer" in params.stages:
            assert checkpoint_uri is not None
            lineage["checkpoint_uri"] = checkpoint_uri
            done = _transfer(params, settings, checkpoint_uri, run_id, lineage, stages["transfer"])
            result["transfer"] = done
            for name, values in done["datasets"].items():
                metrics[f"{name}_test_accuracy"] = float(values["test_accuracy"])
                if values.get("baseline_test_accuracy") is not None:
                    metrics[f"{name}_baseline_test_accuracy"] = float(values["baseline_test_accuracy"])
            if done.get("registered"):
                lineage["model_version"] = str(done["registered"]["version"])
                lineage["model_name"] = done["registered"]["name"]
                lineage["transfer_run_id"] = done["run_id"]
    except BaseException:
        close_pipeline_run(run_id, stages | _failed(stages), lineage, metrics, failed=True)
        raise
    summary = _summary(settings, result, lineage)
    close_pipeline_run(run_id, stages, lineage, metrics, failed=False, note=summary)
    _publish_artifacts(result, summary)
    return result


def _failed(stages: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The stage that was running when the pipeline failed has no state yet; later ones never started."""
    states: dict[str, dict[str, Any]] = {}
    for stage, info in stages.items():
        if "state" not in info:
            states[stage] = {**info, "state": "failed" if not states else "not started"}
    return states


def _corpus(params: PipelineParams, settings: Settings, run_id: str, info: dict[str, Any]) -> dict[str, Any]:
    key = corpus_key(params)
    store = store_of(settings)
    info["key"] = key["corpus_id"]
    if store.exists(key["manifest_key"]) and "corpus" not in params.force:
        _skipped("corpus")
        summary = summary_of(read_manifest(store, key["manifest_key"]), store.url(key["manifest_key"]))
        info["state"] = "skipped"
    else:
        state = build_corpus.with_options(task_runner=task_runner(settings))(
            sources=params.sources,
            store=settings.resolved_store_uri,
            config=params.corpus,
            force="corpus" in params.force,
            parent_run_id=run_id,
            return_state=True,
        )
        summary = state.result()
        info.update(state="ran", flow_run_id=_flow_run_id_of(state))
    found = find_run(settings, {"stage": "corpus", "corpus_id": summary["corpus_id"]})
    info["run_id"] = found.info.run_id if found else None
    return summary


def _pretrain(
    params: PipelineParams, settings: Settings, manifest_uri: str, run_id: str, info: dict[str, Any]
) -> dict[str, Any]:
    stage = pretrain_params(params.pretrain, manifest_uri)
    corpus_id = read_corpus_manifest(manifest_uri, endpoint_url=settings.s3_endpoint_url)["corpus_id"]
    forced = "pretrain" in params.force
    stage = stage.model_copy(update={"run": pretrain_run_name(stage, corpus_id, force=forced)})
    job = plan_job(stage, settings)
    info["key"] = stage.run
    if not forced and finished_run(store_of(settings), job.config.run_name, job.stop_step):
        _skipped("pretrain")
        done = job_result(job, settings)
        info["state"] = "skipped"
    else:
        state = pretrain(stage, parent_run_id=run_id, return_state=True)
        done = state.result()
        info.update(state="ran", flow_run_id=_flow_run_id_of(state))
    info["run_id"] = done["run_id"]
    return done


def _transfer(
    params: PipelineParams,
    settings: Settings,
    checkpoint_uri: str,
    run_id: str,
    lineage: dict[str, str],
    info: dict[str, Any],
) -> dict[str, Any]:
    key = transfer_key_task(checkpoint_uri, params)
    record = transfer_record_key(key)
    store = store_of(settings)
    info["key"] = key[:16]
    if store.exists(record) and "transfer" not in params.force:
        _skipped("transfer")
        done = json.loads(store.read_bytes(record))
        info["state"] = "skipped"
    else:
        state = transfer(
            transfer_params(params.transfer, checkpoint_uri),
            parent_run_id=run_id,
            lineage=lineage,
            return_state=True,
        )
        done = state.result()
        # Written last: a transfer that failed half-way is not found by the next run.
        store.write_bytes(record, json.dumps(done, default=str).encode())
        info.update(state="ran", flow_run_id=_flow_run_id_of(state))
    info["run_id"] = done["run_id"]
    return done


def _summary(settings: Settings, result: dict[str, Any], lineage: dict[str, str]) -> str:
    """What the run produced, as markdown with links into MLflow: the Prefect artifact ``pipeline-summary``
    and the MLflow parent run's description. Each line is logged too."""
    from mlflow.tracking import MlflowClient

    logger = get_run_logger()
    experiment = MlflowClient().get_run(result["run_id"]).info.experiment_id
    lines = [f"# Pipeline run {run_link(settings, experiment, result['run_id'])}", ""]
    for stage, info in result["stages"].items():
        link = run_link(settings, experiment, info["run_id"]) if info.get("run_id") else "-"
        lines.append(f"- **{stage}**: {info.get('state')} · MLflow run {link}")
    if "corpus" in result:
        lines.append(f"- corpus: `{result['corpus']['manifest_uri']}` ({result['corpus']['rows']:,} rows)")
    if "pretrain" in result:
        p = result["pretrain"]
        lines.append(f"- checkpoint: `{p['checkpoint_uri']}` (step {p['steps']}, val bpc {p['val_bpc']})")
    for name, values in result.get("transfer", {}).get("datasets", {}).items():
        versus = versus_baseline(values["test_accuracy"], values.get("baseline_test_accuracy"))
        lines.append(f"- {name}: test accuracy {versus}")
    if lineage.get("model_version"):
        lines.append(
            f"- model: {model_link(settings, lineage['model_name'], lineage['model_version'])} "
            f"({result['transfer']['registered']['reason']})"
        )
    for line in lines[2:]:  # a log line shows no markdown: links become their URLs
        plain = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"\2", line.removeprefix("- "))
        logger.info("%s", plain.replace("**", "").replace("`", ""))
    return "\n".join(lines) + "\n"


def _publish_artifacts(result: dict[str, Any], summary: str) -> None:
    """The pipeline's page in the Prefect UI: each stage's state, and links into MLflow."""
    create_table_artifact(
        key="pipeline-stages",
        table=[
            {
                "stage": stage,
                "state": info.get("state"),
                "key": info.get("key"),
                "mlflow_run_id": info.get("run_id"),
                "prefect_flow_run_id": info.get("flow_run_id", "-"),
            }
            for stage, info in result["stages"].items()
        ],
        description="Stages of this pipeline run: ran, or skipped because their inputs had not changed",
    )
    create_markdown_artifact(key="pipeline-summary", markdown=summary, description="What this run produced")
