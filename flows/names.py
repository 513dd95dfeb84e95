"""Flow-run names that say what a run is about, so the Prefect UI's run list reads without clicking.

Prefect calls these when a run starts, with the run's parameters in ``prefect.runtime``; a deployment's
run gets them as JSON, a local call as the models themselves, so both are read alike.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from prefect.runtime import flow_run


def _get(value: Any, key: str, default: Any = None) -> Any:
    if isinstance(value, dict):
        return value.get(key, default)
    return getattr(value, key, default)


def _leaf(uri: str) -> str:
    """The last meaningful part of a path or URI: ``…/reviews/*.json.gz`` → ``reviews``; a URL's host and
    path only (its user-info and query may hold credentials)."""
    if "://" in uri:
        split = urlsplit(uri)
        uri = split.netloc.rpartition("@")[2] + split.path
    parts = [p for p in PurePosixPath(uri).parts if p not in ("/", "") and "*" not in p]
    return parts[-1] if parts else uri


def _sources(sources: list[str] | None) -> str:
    if not sources:
        return "none"
    more = f"+{len(sources) - 1}" if len(sources) > 1 else ""
    return f"{_leaf(sources[0])}{more}"


def _checkpoint(uri: str | None) -> str:
    """``…/runs/tiny-ab12/checkpoints/step-0000400`` → ``tiny-ab12@400``; ``newest`` stays ``newest``."""
    if not uri:
        return "none"
    parts = [p for p in PurePosixPath(uri.split("://", 1)[-1]).parts if p not in ("/", "latest.json")]
    if len(parts) >= 3 and parts[-2] == "checkpoints" and parts[-1].startswith("step-"):
        return f"{parts[-3]}@{int(parts[-1].removeprefix('step-'))}"
    return parts[-1] if parts else uri


def pipeline_name() -> str:
    params = flow_run.parameters.get("params", {})
    stages = _get(params, "stages") or ["corpus", "pretrain", "transfer"]
    preset = _get(_get(params, "pretrain", {}), "preset", "tiny")
    if "corpus" in stages:
        about = _sources(_get(params, "sources"))
    elif "pretrain" in stages:
        about = _leaf(_get(params, "manifest_uri") or "newest")
    else:
        about = _checkpoint(_get(params, "checkpoint_uri") or "newest")
    return f"pipeline-{'+'.join(stages)}-{preset}-{about}"


def corpus_name() -> str:
    return f"corpus-{_sources(flow_run.parameters.get('sources'))}"


def pretrain_name() -> str:
    params = flow_run.parameters.get("params", {})
    return f"pretrain-{_get(params, 'run') or _get(params, 'preset', 'tiny')}"


def finetune_name() -> str:
    params = flow_run.parameters.get("params", {})
    dataset = str(_get(params, "dataset", "") or "").partition("=")[0] or "data"
    return f"finetune-{_get(params, 'run') or _checkpoint(_get(params, 'checkpoint'))}-{dataset}"


def transfer_name() -> str:
    params = flow_run.parameters.get("params", {})
    names = [spec.partition("=")[0] for spec in _get(params, "datasets", [])]
    return f"transfer-{_checkpoint(_get(params, 'checkpoint'))}-{'+'.join(names) or 'none'}"


def register_name() -> str:
    report = flow_run.parameters.get("report", {})
    return f"register-{_get(report, 'name', 'classifier')}"


def sweep_name() -> str:
    spec = flow_run.parameters.get("spec", {})
    budget = _get(spec, "budget", {})
    return f"sweep-{_get(spec, 'sampler', 'random')}-{_get(budget, 'trials')}x{_get(budget, 'max_steps')}"


def score_name() -> str:
    model = flow_run.parameters.get("model") or "champion"
    return f"score-{_sources(flow_run.parameters.get('inputs'))}-{model.rpartition('/')[2]}"
