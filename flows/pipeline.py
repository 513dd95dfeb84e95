"""The pipeline flow: corpus → pretrain → transfer → register (→ finetune, when asked), as subflows under one MLflow parent run.

Each stage is skipped when its inputs have not changed (see ``tasks/pipeline.py`` for the keys), so a
scheduled run that finds nothing new costs seconds. The registered model version carries lineage
tags back to its corpus manifest, its training run and checkpoint, and every Prefect flow run.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.states import State

from flows import names, progress
from flows.corpus import build_corpus
from flows.finetune import finetune
from flows.pretrain import pretrain
from flows.runtime import retry_unless, task_runner
from flows.transfer import transfer
from tasks.corpus.delta import DeltaRefused, plan_build
from tasks.corpus.manifest import read_manifest
from tasks.corpus.result import CorpusResult
from tasks.corpus.sources import SourceError
from tasks.finetune.result import FinetuneResult
from tasks.jobs.checkpoint import read_latest
from tasks.pipeline import (
    PipelineParams,
    Stage,
    finetune_key,
    finetune_params,
    finetune_record_key,
    finished_run,
    pretrain_params,
    pretrain_run_name,
    transfer_key,
    transfer_params,
    transfer_record_key,
)
from tasks.pipeline.record import (
    Incremental,
    PipelineResult,
    StageRecord,
    close_pipeline_run,
    ended_states,
    open_pipeline_run,
    pipeline_metrics,
    registered_lineage,
    stage_lineage,
    stage_seconds,
)
from tasks.pretrain.parent import Parent, champion_checkpoint, read_parent
from tasks.pretrain.result import PretrainResult
from tasks.pretrain.stage import read_corpus_manifest, resolve_corpus
from tasks.settings import Settings, get_settings
from tasks.store import store_of
from tasks.sweep.engine import best_trial
from tasks.sweep.result import BestTrial
from tasks.tracking import find_run, model_link, run_link
from tasks.transfer.result import TransferResult
from tasks.transfer.stage import accuracy_beside_baseline, checkpoints_loaded_once, resolve_checkpoint

# The results of the stages found by a content key (their records in the store).
Keyed = TypeVar("Keyed", TransferResult, FinetuneResult)
# A stage's own result model.
Result = TypeVar("Result")


# A missing source or a refused delta stays so on a retry; a network or store error may pass.
@task(
    name="fingerprint sources",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless(SourceError, DeltaRefused),
)
def corpus_key(params: PipelineParams) -> dict[str, str]:
    """The corpus id of the sources as they are now (fingerprints are cached by size and mtime)."""
    settings = get_settings()
    plan = plan_build(
        params.sources,
        params.corpus,
        store_of(settings),
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
def pipeline(params: PipelineParams) -> PipelineResult:
    """Raw reviews to a registered, promoted sentiment classifier; stages with unchanged inputs skip."""
    settings = get_settings()
    flow_run = get_run_context().flow_run  # type: ignore[union-attr]
    flow_run_id = str(flow_run.id) if flow_run else ""
    run_id = open_pipeline_run(settings, params, {"prefect_flow_run_id": flow_run_id})
    records: dict[str, StageRecord[Any]] = {}  # each stage's, as it ends
    corpus: StageRecord[CorpusResult] | None = None
    trained: StageRecord[PretrainResult] | None = None
    transferred: StageRecord[TransferResult] | None = None
    finetuned: StageRecord[FinetuneResult] | None = None
    # The lineage known so far, a new value at each stage: what a failed run's record can say too.
    lineage = {"pipeline_run_id": run_id, "pipeline_prefect_flow_run_id": flow_run_id}
    get_run_logger().info(
        "stages %s (forced: %s); MLflow parent run %s at %s",
        ", ".join(params.stages), ", ".join(params.force) or "none", run_id, settings.shown_mlflow_tracking_uri,
    )  # fmt: skip
    weekly = Incremental() if params.incremental else None
    champion: Parent | None = None  # an incremental run's parent checkpoint
    planning = 0.0  # seconds an incremental run spent planning its delta: the corpus stage's
    try:
        if weekly is not None:
            champion, weekly = _champion(settings, weekly)
            if "corpus" in params.stages and params.corpus.base is None:
                started = time.perf_counter()
                params, weekly = _grown(params, settings, champion, weekly)
                planning = time.perf_counter() - started
        # A run reads each checkpoint from the store once: the transfer's key, features and registry share it.
        with checkpoints_loaded_once():
            manifest_uri = resolve_corpus(params.manifest_uri, settings) if params.manifest_uri else None
            if "corpus" in params.stages:
                corpus = _timed(lambda: _corpus(params, settings, run_id), spent=planning)
                records["corpus"] = corpus
                manifest_uri = corpus.result.manifest_uri
                if weekly is not None and params.corpus.base is not None:
                    weekly = _delta_of(weekly, corpus, settings)
            checkpoint_uri = (
                resolve_checkpoint(params.checkpoint_uri, settings) if params.checkpoint_uri else None
            )
            if params.from_sweep:
                best = _from_sweep(params.from_sweep, settings)
                lineage = lineage | best.lineage()
                checkpoint_uri, manifest_uri = best.checkpoint_uri, manifest_uri or best.manifest_uri
            if "pretrain" in params.stages:
                assert manifest_uri is not None  # PipelineParams checks it
                stage_manifest = manifest_uri
                records["pretrain"] = trained = _timed(
                    lambda: _pretrain(params, settings, stage_manifest, run_id, champion)
                )
                if champion is not None and weekly is not None:
                    continued = trained.result.run != champion.run  # else it had trained on this corpus
                    weekly = weekly.model_copy(
                        update={"checkpoint": champion.checkpoint_uri, "continued": continued}
                    )
                checkpoint_uri = trained.result.checkpoint_uri
            lineage = (
                lineage | stage_lineage(records) | ({"manifest_uri": manifest_uri} if manifest_uri else {})
            )
            if "transfer" in params.stages:
                assert checkpoint_uri is not None
                lineage = lineage | {"checkpoint_uri": checkpoint_uri}
                probed, known = checkpoint_uri, lineage
                records["transfer"] = transferred = _timed(
                    lambda: _transfer(params, settings, probed, run_id, known)
                )
                lineage = lineage | registered_lineage(transferred.result)
            if "finetune" in params.stages:
                assert checkpoint_uri is not None
                tuned = checkpoint_uri
                records["finetune"] = finetuned = _timed(lambda: _finetune(params, settings, tuned, run_id))
    except BaseException:
        ended = (corpus.result if corpus else None, trained.result if trained else None)
        metrics = pipeline_metrics(*ended, transferred.result if transferred else None, None)
        metrics |= stage_seconds(records)
        close_pipeline_run(run_id, ended_states(params.stages, records), lineage, metrics, failed=True)
        raise
    result = PipelineResult(
        run_id=run_id,
        stages={stage: record.summary() for stage, record in records.items()},
        corpus=corpus.result if corpus else None,
        pretrain=trained.result if trained else None,
        transfer=transferred.result if transferred else None,
        finetune=finetuned.result if finetuned else None,
        incremental=weekly,
    )
    if weekly is not None:
        lineage = lineage | {"incremental": incremental_line(weekly)}
    metrics = pipeline_metrics(result.corpus, result.pretrain, result.transfer, result.finetune)
    metrics |= stage_seconds(records)
    summary = _summary(settings, result, lineage)
    close_pipeline_run(
        run_id, ended_states(params.stages, records), lineage, metrics, failed=False, note=summary
    )
    _publish_artifacts(result, summary)
    return result


def _timed(run: Callable[[], StageRecord[Result]], spent: float = 0.0) -> StageRecord[Result]:
    """The stage's record with its wall seconds here (key, skip check and subflow), plus ``spent``
    on it before (an incremental run's delta planning)."""
    started = time.perf_counter()
    record = run()
    return dataclasses.replace(record, seconds=spent + time.perf_counter() - started)


def _from_sweep(sweep_id: str, settings: Settings) -> BestTrial:
    """The sweep's best trial: its checkpoint, its corpus and the ids the lineage carries."""
    best = best_trial(sweep_id, settings)
    get_run_logger().info(
        "from sweep %s: trial %s (%s), val bpc %.4f", sweep_id, best.trial, best.run, best.value
    )
    return best


def incremental_line(weekly: Incremental) -> str:
    """An incremental run in one line (``status``, the summary): "delta of N rows on corpus X; continued
    from checkpoint Y", or what was found unchanged, and what ran in full instead, and why."""
    said = []
    if weekly.corpus:
        delta = f"delta of {weekly.delta_rows:,} rows on corpus {weekly.corpus}"
        said.append(f"corpus unchanged ({delta}, built before)" if weekly.found else delta)
    elif weekly.found:
        said.append("corpus unchanged")
    if weekly.checkpoint:
        said.append(
            f"{'continued from' if weekly.continued else 'nothing new since'} checkpoint {weekly.checkpoint}"
        )
    return "; ".join([*said, *weekly.full])


def _grown(
    params: PipelineParams, settings: Settings, champion: Parent | None, weekly: Incremental
) -> tuple[PipelineParams, Incremental]:
    """An incremental run's corpus: a delta on the champion's corpus (what the model has not read yet,
    whatever ``corpus-refresh`` grew since), else on the newest corpus in the store, else a full build,
    said in one line (``plan_build`` decides, as for ``corpus-refresh``): no corpus yet, or a base
    source removed or changed."""
    base = champion.corpus if champion is not None else "newest"
    grown = params.model_copy(update={"corpus": params.corpus.model_copy(update={"base": base})})
    plan = plan_build(
        grown.sources,
        grown.corpus.model_copy(update={"fallback": "full"}),
        store_of(settings),
        s3_endpoint_url=settings.s3_endpoint_url,
        cache_path=settings.home / "cache" / "fingerprints.json",
    )
    if plan.full_build_reason is None:
        return grown, weekly
    why = f"incremental: {plan.full_build_reason}"
    get_run_logger().warning("%s", why)
    return params, weekly.model_copy(update={"full": (*weekly.full, why)})


def _delta_of(weekly: Incremental, corpus: StageRecord[CorpusResult], settings: Settings) -> Incremental:
    """The rows the corpus's delta added to its base, and whether the stage found it built before."""
    manifest = read_corpus_manifest(corpus.result.manifest_uri, endpoint_url=settings.s3_endpoint_url)
    found = corpus.state == "skipped"
    if manifest.parent is None or manifest.delta is None:
        return weekly.model_copy(update={"found": found})
    rows = manifest.delta.totals.kept
    return weekly.model_copy(update={"corpus": manifest.parent.corpus_id, "delta_rows": rows, "found": found})


def _champion(settings: Settings, weekly: Incremental) -> tuple[Parent | None, Incremental]:
    """The checkpoint behind the registered champion, which an incremental run continues from; none
    yet: pretraining starts from its own seed, said in one line."""
    try:
        uri = champion_checkpoint(settings)
    except ValueError:
        why = f"incremental: no {settings.model_name}@champion yet: pretraining starts from scratch"
        get_run_logger().info("%s", why)
        return None, weekly.model_copy(update={"full": (*weekly.full, why)})
    options = {"endpoint_url": settings.s3_endpoint_url, "max_attempts": settings.s3_max_attempts}
    return read_parent(uri, **options), weekly


def _corpus(params: PipelineParams, settings: Settings, run_id: str) -> StageRecord[CorpusResult]:
    key = corpus_key(params)
    store = store_of(settings)
    done = store.exists(key["manifest_key"]) and "corpus" not in params.force
    if done:
        _skipped("corpus")
        summary = CorpusResult.of(read_manifest(store, key["manifest_key"]), store.url(key["manifest_key"]))
        flow_run_id = None
    else:
        ran = build_corpus.with_options(task_runner=task_runner(settings))(
            sources=params.sources,
            store=settings.resolved_store_uri,
            config=params.corpus,
            force="corpus" in params.force,
            parent_run_id=run_id,
            return_state=True,
        )
        summary, flow_run_id = ran.result(), _flow_run_id_of(ran)
    found = find_run(settings, {"stage": "corpus", "corpus_id": summary.corpus_id})
    return StageRecord(
        state="skipped" if done else "ran",
        key=key["corpus_id"],
        result=summary,
        run_id=found.info.run_id if found else None,
        flow_run_id=flow_run_id,
    )


def _pretrain(
    params: PipelineParams, settings: Settings, manifest_uri: str, run_id: str, parent: Parent | None
) -> StageRecord[PretrainResult]:
    """The pretraining subflow, skipped when its run is done; ``parent`` (an incremental run's champion)
    continues on the corpus, or is the result itself when the champion was trained on this very corpus."""
    stage = pretrain_params(params.pretrain, manifest_uri)
    corpus_id = read_corpus_manifest(manifest_uri, endpoint_url=settings.s3_endpoint_url).corpus_id
    forced = "pretrain" in params.force
    if parent is not None:
        parent_corpus = read_corpus_manifest(parent.corpus, endpoint_url=settings.s3_endpoint_url)
        latest = read_latest(store_of(settings), parent.run)
        if parent_corpus.corpus_id == corpus_id and latest is not None and not forced:
            _skipped("pretrain")  # nothing new since the champion's corpus
            done = PretrainResult.from_latest(
                parent.run, {**latest, "checkpoint_uri": parent.checkpoint_uri, "step": parent.step}
            )
            return StageRecord(state="skipped", key=parent.run, result=done, run_id=done.run_id)
        # Its own schedule: one pass over the delta (unless pretrain.total_steps says), warmed up over a
        # share of it; a run from scratch's warm-up (the paper's 1,000 steps) can outlast a week's delta.
        continued = {"warmup_steps": 0, "warmup_share": params.continued_warmup}
        stage = stage.model_copy(
            update={"init_from": parent.checkpoint_uri, "replay": params.replay, **continued}
        )
    digest = parent.digest if parent is not None else None
    run = pretrain_run_name(stage, corpus_id, force=forced, parent=digest)
    stage = stage.model_copy(update={"run": run})
    assert stage.run is not None
    # Already done? From the run's latest.json alone: the flow plans the job, once, when it runs.
    finished = None if forced else finished_run(store_of(settings), stage.run, stage.max_steps)
    skip = finished is not None
    if finished is not None:
        _skipped("pretrain")
        done, flow_run_id = PretrainResult.from_latest(stage.run, finished), None
    else:
        ran = pretrain(stage, parent_run_id=run_id, return_state=True)
        done, flow_run_id = ran.result(), _flow_run_id_of(ran)
    return StageRecord(
        state="skipped" if skip else "ran",
        key=stage.run,
        result=done,
        run_id=done.run_id,
        flow_run_id=flow_run_id,
    )


def _transfer(
    params: PipelineParams, settings: Settings, checkpoint_uri: str, run_id: str, lineage: dict[str, str]
) -> StageRecord[TransferResult]:
    key = transfer_key_task(checkpoint_uri, params)
    return _keyed(
        TransferResult,
        "transfer",
        key,
        transfer_record_key(key),
        params,
        settings,
        lambda: transfer(
            transfer_params(params.transfer, checkpoint_uri),
            parent_run_id=run_id,
            lineage=lineage,
            return_state=True,
        ),
    )


def _finetune(
    params: PipelineParams, settings: Settings, checkpoint_uri: str, run_id: str
) -> StageRecord[FinetuneResult]:
    """The fine-tuning subflow, skipped when the same weights, data and settings were fine-tuned before."""
    stage_params = finetune_params(params, checkpoint_uri)
    key = finetune_key(stage_params, settings)
    return _keyed(
        FinetuneResult,
        "finetune",
        key,
        finetune_record_key(key),
        params,
        settings,
        lambda: finetune(stage_params, parent_run_id=run_id, return_state=True),
    )


def _keyed(
    model: type[Keyed],
    stage: Stage,
    key: str,
    record: str,
    params: PipelineParams,
    settings: Settings,
    run: Callable[[], State],
) -> StageRecord[Keyed]:
    """A stage found by its content key: its result read back from its record when it ran before (unless
    forced), else run (``run`` returns the subflow's state) and recorded."""
    store = store_of(settings)
    skip = store.exists(record) and stage not in params.force
    if skip:
        _skipped(stage)
        # json, not pydantic's parser: a probe's sweep may hold NaN (an objective not measured).
        done, flow_run_id = model.model_validate(json.loads(store.read_bytes(record))), None
    else:
        ran = run()
        done, flow_run_id = model.model_validate(ran.result()), _flow_run_id_of(ran)
        # Written last: a stage that failed half-way is not found by the next run.
        store.write_bytes(record, json.dumps(done.model_dump(), default=str).encode())
    return StageRecord(
        state="skipped" if skip else "ran",
        key=key[:16],
        result=done,
        run_id=done.run_id,
        flow_run_id=flow_run_id,
    )


def _summary(settings: Settings, result: PipelineResult, lineage: dict[str, str]) -> str:
    """What the run produced, as markdown with links into MLflow: the Prefect artifact ``pipeline-summary``
    and the MLflow parent run's description. Each line is logged too."""
    from mlflow.tracking import MlflowClient

    logger = get_run_logger()
    experiment = MlflowClient().get_run(result.run_id).info.experiment_id
    lines = [f"# Pipeline run {run_link(settings, experiment, result.run_id)}", ""]
    for stage, info in result.stages.items():
        link = run_link(settings, experiment, info.run_id) if info.run_id else "-"
        took = f" in {info.seconds:.1f} s" if info.seconds is not None else ""
        lines.append(f"- **{stage}**: {info.state}{took} · MLflow run {link}")
    if result.incremental is not None:
        lines.append(f"- incremental: {incremental_line(result.incremental)}")
    if result.corpus is not None:
        lines.append(f"- corpus: `{result.corpus.manifest_uri}` ({result.corpus.rows:,} rows)")
    if (p := result.pretrain) is not None:
        lines.append(f"- checkpoint: `{p.checkpoint_uri}` (step {p.steps}, val bpc {p.val_bpc})")
    for name, values in (result.transfer.datasets if result.transfer else {}).items():
        versus = accuracy_beside_baseline(values.test_accuracy, values.baseline_test_accuracy)
        lines.append(f"- {name}: test accuracy {versus}")
    if (f := result.finetune) is not None:
        lines.append(
            f"- fine-tuned on {f.dataset}: test accuracy {f.test_accuracy:.2%}, registered "
            f"v{f.registered.version} ({f.registered.reason})"
        )
    if result.transfer is not None and (registered := result.transfer.registered) is not None:
        lines.append(
            f"- model: {model_link(settings, lineage['model_name'], lineage['model_version'])} "
            f"({registered.reason})"
        )
    for line in lines[2:]:  # a log line shows no markdown: links become their URLs
        plain = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"\2", line.removeprefix("- "))
        logger.info("%s", plain.replace("**", "").replace("`", ""))
    return "\n".join(lines) + "\n"


def _publish_artifacts(result: PipelineResult, summary: str) -> None:
    """The pipeline's page in the Prefect UI: each stage's state, and links into MLflow."""
    create_table_artifact(
        key="pipeline-stages",
        table=[
            {
                "stage": stage,
                "state": info.state,
                "key": info.key,
                "seconds": round(info.seconds, 1) if info.seconds is not None else "-",
                "mlflow_run_id": info.run_id,
                "prefect_flow_run_id": info.flow_run_id or "-",
            }
            for stage, info in result.stages.items()
        ],
        description="Stages of this pipeline run: ran, or skipped because their inputs had not changed",
    )
    create_markdown_artifact(key="pipeline-summary", markdown=summary, description="What this run produced")
