#!/usr/bin/env python
"""The fine-tuning defaults chosen on dev alone: five candidate settings, dev accuracy each, test read once.

From one checkpoint (the demo's tiny one, pretrained here as ``benchmarks/finetune.py`` does, or
``--checkpoint``), each candidate of ``CANDIDATES`` (pooling, peak learning rate, auxiliary LM weight;
every other setting the command's) fine-tunes on a fixed ``--train-rows`` subset of SST's train split for
the command's epochs. The candidates' runs are given dev in test's place, so the real test split is never
read before the choice: ``choose_on_dev`` sees each candidate's dev accuracy and nothing else, and takes
the highest (ties to the candidate listed first). The chosen settings then fine-tune once on all of
train, beside the frozen probe and the TF-IDF baseline (``finetune.compare``), and that run's test
accuracy is the one test figure the selection reports.

    PYTHONPATH=. .venv/bin/python benchmarks/finetune_select.py --record
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_record_option, machine, new_parser, record, say
from finetune import DEFAULT_DATASETS, compare, finished, pretrained_checkpoint, subsample

# The five settings of the first selection (docs/finetune.md, "How the defaults were chosen"), by the
# names that log gave them: the probe's own feature (last state) at two rates, and the three poolings.
CANDIDATES: dict[str, dict[str, Any]] = {
    "D": {"pool": "last", "lr": 1e-3, "aux_lm_weight": 0.0},
    "E": {"pool": "mean", "lr": 3e-3, "aux_lm_weight": 0.0},
    "F": {"pool": "max", "lr": 3e-3, "aux_lm_weight": 0.0},
    "G": {"pool": "concat", "lr": 3e-3, "aux_lm_weight": 0.1},
    "H": {"pool": "last", "lr": 1e-2, "aux_lm_weight": 0.0},
}
CHOSEN_KEYS = ("pool", "lr", "aux_lm_weight")


def choose_on_dev(dev_accuracy: dict[str, float]) -> str:
    """The candidate with the highest dev accuracy; on a tie, the one listed first. It is given dev
    figures only, so no test figure can enter the choice."""
    return max(dev_accuracy, key=dev_accuracy.__getitem__)  # max keeps the first of equals


def hide_test(spec: str, rows: int | None, folder: Path) -> tuple[str, dict[str, int]]:
    """The dataset as a table folder (``rows`` train rows, ``finetune.subsample``) whose test file is a copy
    of its dev file: a run on it reads the real test split nowhere."""
    hidden, counts = subsample(spec, rows, folder)
    shutil.copyfile(folder / "dev.csv", folder / "test.csv")
    return hidden, {"train": counts["train"], "dev": counts["dev"]}


def tune_on_dev(spec: str, checkpoint: str, run: str, tuning: dict[str, Any]) -> dict[str, Any]:
    """One candidate's fine-tuning on a test-hidden dataset: its best epoch, dev accuracy and seconds."""
    from tasks.finetune.config import FinetuneParams
    from tasks.finetune.stage import plan_job
    from tasks.finetune.train import fit
    from tasks.jobs.world import World
    from tasks.settings import get_settings

    settings = get_settings()
    params = FinetuneParams(checkpoint=checkpoint, dataset=spec, run=run, **tuning)
    config = plan_job(params, settings).config.model_copy(update={"tracking": "off"})
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the job's log lines
        tuned = fit(config, World(), settings)
    finished(tuned["preempted"], tuned["steps"], "fine-tuning")
    return {
        "dev_accuracy": tuned["dev_accuracy"],
        "best_epoch": tuned["best_epoch"],
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument(
        "--checkpoint", help="A pretraining checkpoint. Default: the demo's tiny one, pretrained here."
    )
    parser.add_argument(
        "--pretrain-steps", type=int, default=300, help="tiny's pretraining steps. [300, the demo's]"
    )
    parser.add_argument(
        "--dataset", default=DEFAULT_DATASETS[0], metavar="NAME=PATH", help="Default: the shared SST."
    )
    parser.add_argument("--train-rows", type=int, default=2000, help="Train rows the candidates see. [2000]")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="Which candidates run. [all]")
    add_record_option(parser)
    args = parser.parse_args(argv)
    names = args.candidates.split(",")
    if unknown := [n for n in names if n not in CANDIDATES]:
        parser.error(f"--candidates: unknown {', '.join(unknown)}; expected some of {', '.join(CANDIDATES)}")
    import os

    import torch

    from tasks.finetune.config import FinetuneSettings

    fields = FinetuneSettings.model_fields
    default = {name: fields[name].default for name in CHOSEN_KEYS}
    # The command's other defaults, as benchmarks/finetune.py has them (its texts cut at 512 bytes).
    base = {
        name: fields[name].default
        for name in ("epochs", "batch_size", "head", "sort_batches", "lm_lr_factor")
    }
    base |= {"max_bytes": 512, "freeze_lm": False}
    candidates: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlstm-bench-select-") as scratch:
        home = Path(scratch) / "home"
        os.environ["MLSTM_HOME"] = str(home)
        checkpoint, pretrained = args.checkpoint, args.checkpoint
        if checkpoint is None:
            say(f"pretraining tiny for {args.pretrain_steps} steps")
            checkpoint, pretrained, _ = pretrained_checkpoint(home, "tiny", args.pretrain_steps)
        hidden, counts = hide_test(args.dataset, args.train_rows, Path(scratch) / "hidden")
        say(f"candidates on train {counts['train']:,} (a subsample), dev {counts['dev']:,}; test hidden")
        for name in names:
            tuning = base | CANDIDATES[name]
            row = {
                "name": name,
                "settings": CANDIDATES[name],
                **tune_on_dev(hidden, checkpoint, f"select-{name}", tuning),
            }
            candidates.append(row)
            say(f"  {name} {CANDIDATES[name]}: dev {row['dev_accuracy']:.4f} ({row['seconds']:.0f} s)")
        chosen = choose_on_dev({row["name"]: row["dev_accuracy"] for row in candidates})
        say(f"chosen on dev: {chosen} {CANDIDATES[chosen]}; on all of train, test read once")
        full, full_counts = subsample(args.dataset, None, Path(scratch) / "full")
        measured = {**compare(full, checkpoint, base | CANDIDATES[chosen]), "rows": full_counts}
        say(
            f"  test accuracy {measured['finetune_test_accuracy']:.4f} (dev {measured['finetune_dev_accuracy']:.4f})"
        )
    results = {
        "machine": machine(torch.device("cpu")),
        "checkpoint": pretrained,
        "settings": base,
        "rows": counts,
        "rule": "the highest dev accuracy; ties to the candidate listed first",
        "candidates": candidates,
        "chosen": chosen,
        "default_when_run": default,
        "chosen_run": measured,
    }
    record("finetune-select", args.record, results, argv=argv, script="finetune_select")


if __name__ == "__main__":
    main()
