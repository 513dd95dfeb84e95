"""``mlstm-sentiment sweep SPEC.yaml | sweep status [SWEEP]``: search pretraining settings with ASHA."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from flows.cli.common import JsonOption, StoreOption, fail, options_from, out, parsed, run_flow, user_errors
from tasks.settings import get_settings
from tasks.sweep.config import SweepRunOptions

if TYPE_CHECKING:
    from tasks.sweep.result import SweepResult
    from tasks.sweep.spec import SweepSpec


class SpecOrCommand(TyperGroup):
    """``sweep SPEC.yaml`` is ``sweep run SPEC.yaml``: a first word that is no command is a spec."""

    # Typer vendors click; its types are private, so the signature is the parent's as it stands.
    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=SpecOrCommand, no_args_is_help=True, help="Hyperparameter search over pretraining.")
PANEL = "Sweep"


def run_sweep(spec: SweepSpec, parallel: int = 1, *, show_progress: bool = True) -> SweepResult:
    """The ``sweep`` flow in this process; a spec that cannot run fails before the Prefect API starts."""
    from flows.sweep import sweep as sweep_flow
    from tasks.sweep.engine import prepare

    prepare(spec, get_settings())
    return run_flow(sweep_flow, unit="step", show_progress=show_progress, spec=spec, parallel=parallel)


@app.command("run", rich_help_panel=PANEL)
@options_from(SweepRunOptions, SweepRunOptions.model_fields)
def run(
    spec_path: Annotated[str, typer.Argument(metavar="SPEC.yaml", help="The sweep spec (docs/sweep.md).")],
    store: StoreOption = None,
    as_json: JsonOption = False,
    **settings: Any,
) -> None:
    """Run a sweep (or continue it: the same spec is the same sweep); `sweep SPEC.yaml` for short."""
    import os

    from tasks.jobs.launchers.base import LaunchError
    from tasks.sweep.spec import load_spec

    options = parsed(SweepRunOptions, settings)
    if store:
        os.environ["MLSTM_STORE_URI"] = store
    try:
        result = run_sweep(load_spec(spec_path), options.parallel, show_progress=not as_json)
    except user_errors(LaunchError) as error:
        raise fail(error) from None
    if as_json:
        print(json.dumps(result.shown()))
        return
    print_table(result)


@app.command(rich_help_panel=PANEL)
def status(
    sweep_id: Annotated[
        str | None, typer.Argument(metavar="[SWEEP]", help="A sweep id; default: list the sweeps.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """The sweeps in Optuna's storage, or one sweep's trials: rung, state, steps, objective, run."""
    from tasks.sweep.engine import list_sweeps, load_study, summary

    settings = get_settings()
    try:
        if sweep_id is None:
            sweeps = list_sweeps(settings)
            if as_json:
                print(json.dumps(sweeps))
                return
            if not sweeps:
                out.print("no sweeps yet: mlstm-sentiment sweep SPEC.yaml")
            for row in sweeps:
                best = "-" if row["best"] is None else f"{row['best']:.4f}"
                out.print(
                    f"{row['sweep_id']}  {row['started'] or '-':<19}  {row['trials']} trials  "
                    f"{row['states']}  best val_bpc {best}",
                    highlight=False,
                )
            return
        result = summary(load_study(sweep_id, settings))
    except user_errors() as error:
        raise fail(error) from None
    if as_json:
        print(json.dumps(result.shown()))
        return
    print_table(result)


def print_table(result: SweepResult) -> None:
    from rich.table import Table

    table = Table(title=f"sweep {result.sweep_id}: {result.steps_trained:,} steps trained")
    for column in ("trial", "rung", "state", "steps", "val_bpc", "run"):
        table.add_column(
            column, justify="right" if column in ("trial", "rung", "steps", "val_bpc") else "left"
        )
    best = result.best
    for row in result.trials:
        value = "-" if row.value is None else f"{row.value:.4f}"
        mark = " ★" if best and row.trial == best.trial else ""
        cells = [str(row.trial), str(row.rung), row.state + mark, str(row.steps), value]
        table.add_row(*cells, str(row.run))
    out.print(table)
    if best:
        out.print(f"best: trial {best.trial} {best.params} val bpc {best.value:.4f}", highlight=False)
        out.print(f"checkpoint: {best.checkpoint_uri}", highlight=False)
