"""The transfer stage's fits on features already made: the L1 probe over feature files, and the
TF-IDF baseline the probe is measured against."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.common import check_datasets, err, fail, out, user_errors
from tasks.settings import get_settings

app = typer.Typer()
PANEL = "Transfer"


@app.command(rich_help_panel=PANEL)
def probe(
    train: Annotated[str, typer.Option(help="Arrow features of the train split (a path or s3:// URI).")],
    dev: Annotated[str, typer.Option(help="Arrow features of the dev split: chooses C.")],
    test: Annotated[str, typer.Option(help="Arrow features of the test split: scores the probe.")],
    features_column: Annotated[str, typer.Option(help="The column of feature vectors.")] = "features",
    label_column: Annotated[str, typer.Option(help="The column of 0/1 labels.")] = "label",
    solver: Annotated[
        str, typer.Option(help="newton (fast), liblinear (the reference) or torch (CPU threads or GPU).")
    ] = "newton",
    c_min_log2: Annotated[int, typer.Option(help="Smallest C of the sweep, as a power of 2.")] = -8,
    c_max_log2: Annotated[int, typer.Option(help="Largest C of the sweep, as a power of 2.")] = 2,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print {test_accuracy, dev_accuracy, C, nonzero, top_unit, …, seconds}."),
    ] = False,
) -> None:
    """Fit the L1 probe on precomputed features (what `features` writes); one line per C on stderr."""
    import torch

    from tasks.transfer.precomputed import probe_files
    from tasks.transfer.probe import SweepPoint
    from tasks.transfer.solvers import SOLVERS

    if solver not in SOLVERS:
        raise fail(f"--solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    if c_min_log2 > c_max_log2:
        raise fail(f"--c-min-log2 {c_min_log2} is above --c-max-log2 {c_max_log2}")
    settings = get_settings()

    def on_fit(point: SweepPoint) -> None:
        err.print(str(point), highlight=False)

    try:
        _, summary = probe_files(
            train, dev, test,
            features_column=features_column, label_column=label_column,
            solver=solver,  # checked against SOLVERS above
            device="cuda" if torch.cuda.is_available() else "cpu",
            Cs=tuple(2.0**k for k in range(c_min_log2, c_max_log2 + 1)),
            endpoint_url=settings.s3_endpoint_url, on_fit=on_fit,
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
