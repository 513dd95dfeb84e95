#!/usr/bin/env python
"""The measured TF-IDF baseline on the shared SST and IMDB data: the figure a probe is compared with.

Runs ``tasks/transfer/baseline.py``'s ``fit_baseline`` (the same code as ``mlstm-sentiment baseline`` and
the transfer stage) on each ``--dataset NAME=PATH``, and records per dataset: test and dev accuracy of the
C chosen on dev, every C's dev accuracy, the rows per split, the seconds and the process's peak RSS.

    PYTHONPATH=. .venv/bin/python benchmarks/baseline.py --record
    PYTHONPATH=. .venv/bin/python benchmarks/baseline.py --dataset sst2=../shared/data/sst2 --json
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from common import REPO, add_record_option, machine, new_parser, record, say

# The shared data beside the checkout (MLSTM_SHARED_DIR overrides, as in the tests).
SHARED_DATA = Path(os.environ.get("MLSTM_SHARED_DIR", REPO.parent / "shared")) / "data"
DEFAULT_DATASETS = [f"sst2={SHARED_DATA / 'sst2'}", f"imdb={SHARED_DATA / 'imdb'}"]


def measure(spec: str) -> dict[str, Any]:
    """One dataset's baseline, with every C's dev accuracy."""
    from tasks.transfer.baseline import fit_baseline
    from tasks.transfer.datasets import load_dataset

    start = time.perf_counter()
    dataset = load_dataset(spec)
    sweep: list[dict[str, float]] = []
    result = fit_baseline(dataset, on_C=lambda C, dev: sweep.append({"C": C, "dev_accuracy": dev}))
    return {
        "dataset": dataset.name,
        "kind": dataset.kind,
        "dev_rule": dataset.dev_from_train or "its own dev split",
        "rows": {name: len(split) for name, split in dataset.splits().items()},
        **result.as_dict(),
        "seconds_with_loading": time.perf_counter() - start,
        "sweep": sweep,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument(
        "--dataset",
        action="append",
        metavar="NAME=PATH",
        help="A labelled dataset, as the CLI takes it (repeat). Default: the shared SST and IMDB.",
    )
    parser.add_argument("--json", action="store_true", help="Print the results as JSON on stdout.")
    add_record_option(parser)
    args = parser.parse_args(argv)
    import sklearn

    rows = []
    for spec in args.dataset or DEFAULT_DATASETS:
        say(f"baseline on {spec}")
        rows.append(measure(spec))
        row = rows[-1]
        say(
            f"  {row['dataset']}: test {row['test_accuracy']:.4f}, dev {row['dev_accuracy']:.4f} at C = "
            f"{row['C']:g}, {row['seconds']:.0f} s, peak RSS {row['peak_rss_gib']:.1f} GiB"
        )
    results = {"machine": machine(sklearn=sklearn.__version__), "rows": rows}
    if args.json:
        print(json.dumps(results, indent=2))
    record("baseline", args.record, results, argv=argv)


if __name__ == "__main__":
    main()
