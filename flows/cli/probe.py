"""The transfer stage's fits on features already made: the L1 probe over feature files, and the
TF-IDF baseline the probe is measured against."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from flows.cli.common import check_datasets, err, fail, options_from, out, parsed, user_errors
from tasks.settings import get_settings
from tasks.transfer.config import ProbeFilesParams

app = typer.Typer()
PANEL = "Transfer"


# The command's parameters as flags: the files', then the probe's (tasks/transfer/config.py, shared
# with `transfer`).
SETTINGS = ("train", "dev", "test", "features_column", "label_column", "solver", "c_min_log2", "c_max_log2",
            "seed")  # fmt: skip


@app.command(rich_help_panel=PANEL)
@options_from(ProbeFilesParams, SETTINGS)
def probe(
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print {test_accuracy, dev_accuracy, C, nonzero, top_unit, …, seconds}."),
    ] = False,
    **settings: Any,
) -> None:
    """Fit the L1 probe on precomputed features (what `features` writes); one line per C on stderr."""
    params = parsed(ProbeFilesParams, settings)
    import torch

    from tasks.transfer.precomputed import probe_files
    from tasks.transfer.probe import SweepPoint

    def on_fit(point: SweepPoint) -> None:
        err.print(str(point), highlight=False)

    try:
        _, summary = probe_files(
            params.train, params.dev, params.test,
            features_column=params.features_column, label_column=params.label_column,
            solver=params.solver, seed=params.seed, Cs=params.Cs,
            device="cuda" if params.solver == "newton" and torch.cuda.is_available() else "cpu",
            endpoint_url=get_settings().s3_endpoint_url, on_fit=on_fit,
        )  # fmt: skip
    except user_errors() as error:  # FeatureFileError is a ValueError
        raise fail(error) from None
    if as_json:
        print(json.dumps(summary))
        return
    out.print(
        f"test accuracy {summary['test_accuracy']:.4f} (dev {summary['dev_accuracy']:.4f}) at C = {summary['C']:g}, "
        f"{summary['nonzero']:,} non-zero weights; unit {summary['top_unit']} alone: "
        f"{summary['top_unit_accuracy']:.4f}; {summary['seconds']:.1f} s",
        highlight=False,
    )


@app.command(rich_help_panel=PANEL)
def baseline(
    dataset: Annotated[
        list[str], typer.Option(help="NAME=PATH or PATH of a labelled dataset; repeat for several.")
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {NAME: {test_accuracy, …}} as JSON.")
    ] = False,
) -> None:
    """Measure the TF-IDF + logistic-regression baseline on each dataset (C chosen on dev)."""
    from tasks.transfer.baseline import fit_baseline
    from tasks.transfer.datasets import load_dataset

    check_datasets(dataset)
    results: dict[str, dict[str, float]] = {}
    for spec in dataset:
        try:
            data = load_dataset(spec)
            results[data.name] = fit_baseline(data).as_dict()
        except user_errors() as error:
            raise fail(error) from None
    if as_json:
        print(json.dumps(results, indent=2))
        return
    table = Table("dataset", "test accuracy", "dev accuracy", "C", "seconds")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['test_accuracy']:.2%}",
            f"{r['dev_accuracy']:.2%}",
            f"{r['C']:g}",
            f"{r['seconds']:.1f}",
        )
    out.print(table)
