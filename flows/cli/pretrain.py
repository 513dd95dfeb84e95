"""``mlstm-sentiment pretrain``: train the mLSTM on a corpus, here, under Slurm or on Kubernetes."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import JsonOption, StoreOption, fail, out, run_flow, user_errors
from tasks.settings import get_settings

if TYPE_CHECKING:
    from tasks.pretrain.stage import PretrainParams

app = typer.Typer()
PANEL = "Pretrain"


def run_pretrain(params: PretrainParams, *, show_progress: bool = True) -> dict[str, Any]:
    """Train as a Prefect flow run (the job itself under torchrun, Slurm or Kubernetes)."""
    from flows.pretrain import pretrain as pretrain_flow
    from tasks.pretrain.stage import plan_job

    plan_job(params, get_settings())  # bad settings fail here, before a Prefect API or a process starts
    return run_flow(pretrain_flow, unit="step", show_progress=show_progress, params=params)


@app.command(rich_help_panel=PANEL)
def pretrain(
    corpus: Annotated[str, typer.Option(help="URI of the corpus manifest.json.")],
    preset: Annotated[str, typer.Option(help="tiny, small, paper_4096 or paper_8192.")] = "tiny",
    launcher: Annotated[str, typer.Option(help="local (torchrun here), slurm or kubernetes.")] = "local",
    nodes: Annotated[int, typer.Option(min=1, help="Nodes (slurm, kubernetes).")] = 1,
    gpus_per_node: Annotated[int, typer.Option(min=0, help="GPUs per node, one process each.")] = 0,
    nproc: Annotated[
        int | None, typer.Option(min=1, help="Processes per node without GPUs. [default: 1]")
    ] = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="End this launch after this step.")] = None,
    total_steps: Annotated[
        int | None, typer.Option(min=1, help="Schedule length. [default: one epoch of train]")
    ] = None,
    run: Annotated[str | None, typer.Option(help="Run name; the same name resumes. [default: new]")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Global batch in rows.")] = 128,
    seq_len: Annotated[int, typer.Option(min=1, help="Truncated BPTT length in bytes.")] = 256,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 5e-4,
    lr_scaling: Annotated[str, typer.Option(help="none, linear or sqrt.")] = "none",
    warmup_steps: Annotated[int, typer.Option(min=0, help="Linear warm-up steps.")] = 0,
    precision: Annotated[str, typer.Option(help="auto, bf16, fp16 or fp32.")] = "auto",
    sharding: Annotated[str, typer.Option(help="none (DDP), optimizer (ZeRO-1) or full (FSDP2).")] = "none",
    gpu_memory: Annotated[float, typer.Option(help="GiB per GPU, checked before launch.")] = 80.0,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Steps between checkpoints.")] = 1000,
    val_every: Annotated[int, typer.Option(min=1, help="Steps between validations.")] = 1000,
    log_every: Annotated[int, typer.Option(min=1, help="Steps between progress lines.")] = 10,
    retries: Annotated[int, typer.Option(min=0, help="Relaunches after a crash (resuming).")] = 2,
    recurrence: Annotated[
        str, typer.Option(help="fused, or reference (the cell step by step: debugging).")
    ] = "fused",
    compile: Annotated[
        str, typer.Option(help="auto (gate math through torch.compile on CUDA) or off.")
    ] = "auto",
    cuda_graph: Annotated[
        str, typer.Option(help="auto (one CUDA graph per step on one GPU) or off.")
    ] = "auto",
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Pretrain the mLSTM on a corpus; relaunching with the same --run resumes from its latest checkpoint."""
    from pydantic import ValidationError

    from tasks.pretrain.launchers.base import LaunchError
    from tasks.pretrain.stage import PretrainParams, flag_errors

    if store:
        os.environ["MLSTM_STORE_URI"] = store
    try:
        params = PretrainParams(
            corpus=corpus, preset=preset, launcher=launcher, nodes=nodes, gpus_per_node=gpus_per_node,
            nproc=nproc, max_steps=max_steps, total_steps=total_steps, run=run, batch_size=batch_size,
            seq_len=seq_len, lr=lr, lr_scaling=lr_scaling, warmup_steps=warmup_steps, precision=precision,
            sharding=sharding, gpu_memory=gpu_memory,
            checkpoint_every=checkpoint_every, val_every=val_every, log_every=log_every, retries=retries,
            recurrence=recurrence, compile=compile, cuda_graph=cuda_graph,
        )  # fmt: skip
        result = run_pretrain(params)
    except ValidationError as error:
        raise fail(flag_errors(error)) from None
    except user_errors(LaunchError) as error:
        raise fail(error) from None
    if as_json:
        print(
            json.dumps({k: result[k] for k in ("run_id", "checkpoint_uri", "steps", "final_loss", "val_bpc")})
        )
        return
    out.print(
        f"[bold green]run {result['run']}[/]: step {result['steps']:,} of {result['total_steps']:,}, "
        f"loss {result['final_loss']:.4f}, val bpc {result['val_bpc']}"
    )
    out.print(f"checkpoint: {result['checkpoint_uri']}", highlight=False)
    out.print(f"MLflow run: {result['run_id']}", highlight=False)


@app.command(rich_help_panel=PANEL)
def plan(
    preset: Annotated[str, typer.Option(help="Model preset, e.g. paper_8192 or large_32768.")],
    batch_size: Annotated[int, typer.Option(min=1, help="Global batch in rows.")],
    nodes: Annotated[int, typer.Option(min=1, help="Nodes.")] = 1,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node.")] = 1,
    seq_len: Annotated[int, typer.Option(min=1, help="Truncated BPTT length in bytes.")] = 256,
    sharding: Annotated[str, typer.Option(help="none, optimizer or full.")] = "none",
    gpu_memory: Annotated[float, typer.Option(min=0.001, help="GiB per GPU.")] = 80.0,
    precision: Annotated[str, typer.Option(help="bf16, fp16 or fp32 compute.")] = "bf16",
    recurrence: Annotated[str, typer.Option(help="fused or reference (the cell step by step).")] = "fused",
    as_json: JsonOption = False,
) -> None:
    """Per-GPU memory of a launch (weights, grads, Adam, activations, workspace): does it fit, and if not, what would."""
    from models.mlstm import RECURRENCES
    from tasks.pretrain.memory import plan as plan_memory
    from tasks.pretrain.sharding import SHARDINGS

    if sharding not in SHARDINGS:
        raise fail(f"--sharding {sharding!r}: choose one of {', '.join(SHARDINGS)}")
    if precision not in ("bf16", "fp16", "fp32"):
        raise fail(f"--precision {precision!r}: choose one of bf16, fp16, fp32")
    if recurrence not in RECURRENCES:
        raise fail(f"--recurrence {recurrence!r}: choose one of {', '.join(RECURRENCES)}")
    try:
        result = plan_memory(
            preset, nodes=nodes, gpus_per_node=gpus_per_node, batch_size=batch_size, seq_len=seq_len,
            sharding=sharding, gpu_memory_gib=gpu_memory,  # narrowed by the check above
            compute_bytes=4 if precision == "fp32" else 2, recurrence=recurrence,
        )  # fmt: skip
    except ValueError as error:
        raise fail(f"--preset: {error}") from None
    if as_json:
        print(json.dumps(result.to_json()))
    else:
        out.print(result.message(), highlight=False)
    if not result.fits:
        raise typer.Exit(1)
