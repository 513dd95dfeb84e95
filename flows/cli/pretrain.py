"""``mlstm-sentiment pretrain``: train the mLSTM on a corpus, here, under Slurm or on Kubernetes."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

import typer

from flows.cli.common import JsonOption, StoreOption, fail, options_from, out, run_flow, styled, user_errors
from models.config import Recurrence
from tasks.jobs.config import Sharding, flag_errors
from tasks.pretrain.config import PretrainParams
from tasks.pretrain.result import PretrainResult
from tasks.settings import get_settings

app = typer.Typer()
PANEL = "Pretrain"


def run_pretrain(params: PretrainParams, *, show_progress: bool = True) -> PretrainResult:
    """Train as a Prefect flow run (the job itself under torchrun, Slurm or Kubernetes)."""
    from tasks.pretrain.stage import plan_job

    plan_job(params, get_settings())  # bad settings fail here, before a Prefect API or a process starts
    from flows.pretrain import pretrain as pretrain_flow

    return run_flow(pretrain_flow, unit="step", show_progress=show_progress, params=params)


# The stage's settings as flags: each is declared once, in tasks/pretrain/config.py.
SETTINGS = list(PretrainParams.model_fields)


@app.command(rich_help_panel=PANEL)
@options_from(PretrainParams, SETTINGS)
def pretrain(store: StoreOption = None, as_json: JsonOption = False, **settings: Any) -> None:
    """Pretrain the mLSTM on a corpus; relaunching with the same --run resumes from its latest checkpoint."""
    from pydantic import ValidationError

    from tasks.jobs.launchers.base import LaunchError

    if store:
        os.environ["MLSTM_STORE_URI"] = store
    try:
        params = PretrainParams(**settings)
        result = run_pretrain(params)
    except ValidationError as error:
        raise fail(flag_errors(error)) from None
    except user_errors(LaunchError) as error:
        raise fail(error) from None
    if as_json:
        print(
            json.dumps(
                result.model_dump(include={"run_id", "checkpoint_uri", "steps", "final_loss", "val_bpc"})
            )
        )
        return
    out.print(
        styled(f"run {result.run}", "bold green"),
        f": step {result.steps:,} of {result.total_steps:,}, "
        f"loss {result.final_loss:.4f}, val bpc {result.val_bpc}",
        sep="",
    )
    out.print(f"checkpoint: {result.checkpoint_uri}", highlight=False)
    if params.init_from:
        out.print(f"continued from: {params.init_from}", highlight=False)
    out.print(f"MLflow run: {result.run_id}", highlight=False)


@app.command(rich_help_panel=PANEL)
def plan(
    preset: Annotated[str, typer.Option(help="Model preset, e.g. paper_8192 or large_32768.")],
    batch_size: Annotated[int, typer.Option(min=1, help="Global batch in rows.")],
    nodes: Annotated[int, typer.Option(min=1, help="Nodes.")] = 1,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node.")] = 1,
    seq_len: Annotated[int, typer.Option(min=1, help="Truncated BPTT length in bytes.")] = 256,
    sharding: Annotated[Sharding, typer.Option(help="none, optimizer or full.")] = "none",
    gpu_memory: Annotated[float, typer.Option(min=0.001, help="GiB per GPU.")] = 80.0,
    precision: Annotated[
        Literal["bf16", "fp16", "fp32"], typer.Option(help="bf16, fp16 or fp32 compute.")
    ] = "bf16",
    recurrence: Annotated[
        Recurrence, typer.Option(help="fused or reference (the cell step by step).")
    ] = "fused",
    as_json: JsonOption = False,
) -> None:
    """Per-GPU memory of a launch (weights, grads, Adam, activations, workspace): does it fit, and if not, what would."""
    from tasks.pretrain.memory import plan as plan_memory

    try:
        result = plan_memory(
            preset, nodes=nodes, gpus_per_node=gpus_per_node, batch_size=batch_size, seq_len=seq_len,
            sharding=sharding, gpu_memory_gib=gpu_memory,
            compute_bytes=4 if precision == "fp32" else 2, recurrence=recurrence,
        )  # fmt: skip
    except ValueError as error:
        raise fail(error) from None
    if as_json:
        print(json.dumps(result.to_json()))
    else:
        out.print(result.message(), highlight=False)
    if not result.fits:
        raise typer.Exit(1)
