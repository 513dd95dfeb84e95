"""``mlstm-sentiment finetune``: train the mLSTM and a head on a labelled dataset, register the result."""

from __future__ import annotations

import json
import os
from typing import Any

import typer

from flows.cli.common import JsonOption, StoreOption, fail, options_from, out, run_flow, user_errors
from tasks.finetune.config import FinetuneParams, flag_errors
from tasks.finetune.result import FinetuneResult
from tasks.settings import get_settings

app = typer.Typer()
PANEL = "Transfer"

# The stage's settings as flags: each is declared once, in tasks/finetune/config.py.
SETTINGS = list(FinetuneParams.model_fields)


def run_finetune(params: FinetuneParams, *, show_progress: bool = True) -> FinetuneResult:
    """Fine-tune as a Prefect flow run (the job itself under torchrun, Slurm or Kubernetes)."""
    from tasks.finetune.stage import plan_job

    plan_job(params, get_settings())  # a bad dataset or setting fails here, before Prefect or a process
    from flows.finetune import finetune as finetune_flow

    return run_flow(finetune_flow, unit="step", show_progress=show_progress, params=params)


@app.command(rich_help_panel=PANEL)
@options_from(FinetuneParams, SETTINGS)
def finetune(store: StoreOption = None, as_json: JsonOption = False, **settings: Any) -> None:
    """Fine-tune the mLSTM and a classifier head on a labelled dataset (Kant et al. 2018); register it as a
    challenger to the champion. The same --run resumes."""
    from pydantic import ValidationError

    from tasks.jobs.launchers.base import LaunchError

    if store:
        os.environ["MLSTM_STORE_URI"] = store
    try:
        params = FinetuneParams(**settings)
        result = run_finetune(params)
    except ValidationError as error:
        raise fail(flag_errors(error)) from None
    except user_errors(LaunchError) as error:  # DatasetError is a ValueError
        raise fail(error) from None
    report, registered = result.report, result.registered
    if as_json:
        print(json.dumps({"run_id": result.run_id, "test_accuracy": result.test_accuracy,
                          "dev_accuracy": result.dev_accuracy, "best_epoch": result.best_epoch,
                          "model_uri": result.model_uri, "probe": report.probe and report.probe.model_dump(),
                          "baseline": report.baseline and report.baseline.model_dump(),
                          "version": registered.version, "promoted": registered.promoted}))  # fmt: skip
        return
    probe = f", frozen probe {report.probe.test_accuracy:.2%}" if report.probe else ""
    baseline = f", TF-IDF {report.baseline.test_accuracy:.2%}" if report.baseline else ""
    out.print(
        f"fine-tuned on {report.name}: test accuracy {result.test_accuracy:.2%}{probe}{baseline} "
        f"(epoch {result.best_epoch} chosen on dev, {result.dev_accuracy:.2%})",
        highlight=False,
    )
    out.print(f"registered {registered.name} v{registered.version}: {registered.reason}", highlight=False)
    out.print(f"MLflow run: {result.run_id}", highlight=False)
