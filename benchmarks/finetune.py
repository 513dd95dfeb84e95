#!/usr/bin/env python
"""Fine-tuning against the frozen probe and the TF-IDF baseline, from one checkpoint, on the same splits.

The checkpoint is pretrained here first unless ``--checkpoint`` names one: by default the demo's tiny
mLSTM (``mlstm-sentiment demo``'s pretraining: the generated sample corpus, batch 16 × 64 bytes, lr 3e-3,
300 steps); ``--pretrain small:150`` the small preset, 150 steps on the shared Amazon reviews (the files,
batch, length and lr of the probe benchmark's real cell states, ``cell_states.py``).
Each ``--dataset`` is read by the transfer stage's loader; ``--train-rows`` keeps a fixed random subset
of its train split (dev and test whole; default all of SST's 6,920) for shorter runs, and the probe,
the baseline and the fine-tuning all see that same subset. Per dataset: test accuracy and seconds of

- the frozen probe: the transfer stage's features and L1 probe (``tasks.finetune.stage.frozen_probe``),
- the TF-IDF baseline (``tasks.transfer.baseline``),
- fine-tuning: the job's ``fit`` on one rank in this process (``tasks.finetune.train``).

Throughput: chars/s of a fine-tuning step (forward, backward, Adam over the batch's bytes) against the
pretraining step's (``tasks.pretrain.step.optimizer_step``, batch × 256 bytes) on the same preset, each
timed over a few steps after one warm-up step. Presets beyond the checkpoint's start from fresh weights:
their speed does not depend on the weights.

    PYTHONPATH=. .venv/bin/python benchmarks/finetune.py --record
    PYTHONPATH=. .venv/bin/python benchmarks/finetune.py --pretrain small:150 --epochs 1 --speed-presets "" --record small
    PYTHONPATH=. .venv/bin/python benchmarks/finetune.py --pool last --lr 1e-3 --aux-lm-weight 0 --train-rows 2000

``--precision bf16`` fine-tunes under bf16 autocast and reads the probe's features in bf16 (the job's
own dev and test scoring stays fp32); the pretraining of ``--pretrain`` stays fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, add_record_option, machine, new_parser, record, say

SHARED_DATA = Path(os.environ.get("MLSTM_SHARED_DIR", REPO.parent / "shared")) / "data"
DEFAULT_DATASETS = [f"sst2={SHARED_DATA / 'sst2'}"]


def pretrained_checkpoint(home: Path, preset: str, steps: int) -> tuple[str, str, float]:
    """A checkpoint of ``preset`` pretrained by the job in this process for ``steps`` steps; its URI, what
    it is, and the seconds it took (corpus included). tiny: the demo's (its generated sample, 16 × 64
    bytes, lr 3e-3, the schedule one epoch of it); any other preset: the shared Amazon reviews the probe's
    real cell states read (``cell_states.AMAZON_FILES``), with their batch, length and lr, the schedule
    ``steps`` long (an epoch of those files is about 127 steps: the job would stop there)."""
    from cell_states import AMAZON_FILES, BATCH, LR, SEQ_LEN

    from tasks.corpus.build import CorpusConfig, build_in_process, plan_corpus
    from tasks.corpus.sample import write_sample
    from tasks.jobs.world import World
    from tasks.pretrain.config import TrainConfig
    from tasks.pretrain.train import fit
    from tasks.settings import get_settings
    from tasks.store import LocalStore

    started = time.perf_counter()
    if preset == "tiny":
        files, batch, seq_len, lr = write_sample(home / "sample", num_reviews=3000), 16, 64, 3e-3
        total_steps, source = None, "the demo's generated sample"
    else:
        files, batch, seq_len, lr = [SHARED_DATA / "amazon" / f for f in AMAZON_FILES], BATCH, SEQ_LEN, LR
        total_steps, source = steps, "the shared Amazon reviews"
        if missing := [str(f) for f in files if not f.is_file()]:
            raise SystemExit(f"finetune benchmark: the shared Amazon files are missing: {', '.join(missing)}")
    manifest = build_in_process(
        plan_corpus([str(f) for f in files], CorpusConfig()), LocalStore(home / "store")
    )
    corpus = str(home / "store" / "corpora" / manifest.corpus_id / "manifest.json")
    config = TrainConfig(
        corpus=corpus, run_name=f"bench-{preset}", preset=preset, batch_size=batch, seq_len=seq_len, lr=lr,
        max_steps=steps, total_steps=total_steps, checkpoint_every=steps, val_every=steps, tracking="off",
    )  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):  # the job's log lines: stdout is --json's
        result = fit(config, World(), get_settings())
    finished(result.preempted, result.steps, "pretraining")
    val_bpc = result.val_bpc  # None where the val split is shorter than a row (the demo's sample)
    validation = "no validation" if val_bpc is None else f"validation {val_bpc:.3f} bits per byte"
    what = f"{preset}, pretrained here for {result.steps} steps of {batch} × {seq_len} bytes on {source} ({validation})"
    return str(result.checkpoint_uri), what, time.perf_counter() - started


def finished(preempted: bool, steps: int, job: str) -> None:
    """Stop the benchmark where its in-process job was stopped (SIGTERM, as a scheduler preempts): the
    job checkpoints and returns, and what came next would be measured on an unfinished model."""
    if preempted:
        raise SystemExit(f"finetune benchmark: the {job} job was stopped at step {steps}; nothing recorded")


def preset_steps(value: str) -> tuple[str, int]:
    """``--pretrain``'s PRESET:STEPS, refused by name before any work."""
    from models.config import PRESETS

    preset, _, steps = value.partition(":")
    if preset not in PRESETS or not steps.isdigit() or int(steps) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected PRESET:STEPS, a preset of {', '.join(PRESETS)} and a step count ≥ 1"
        )
    return preset, int(steps)


def subsample(spec: str, rows: int | None, folder: Path) -> tuple[str, dict[str, int]]:
    """The dataset as a table folder with at most ``rows`` train rows (a fixed random subset)."""
    import numpy as np

    from tasks.transfer.datasets import load_dataset

    dataset = load_dataset(spec)
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, split in dataset.splits().items():
        keep = np.arange(len(split))
        if name == "train" and rows is not None and rows < len(split):
            keep = np.sort(np.random.default_rng(0).choice(len(split), rows, replace=False))
        with (folder / f"{name}.csv").open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["text", "label"])
            writer.writerows((split.texts[i], int(split.labels[i])) for i in keep)
        counts[name] = len(keep)
    return f"{dataset.name}={folder}", counts


def step_speeds(
    preset: str, batch_size: int, texts: list[str], *, steps: int, max_bytes: int, sort_batches: int
) -> dict[str, float]:
    """Chars/s of a pretraining step (batch × 256 bytes) and of a fine-tuning step (batch texts, in the
    job's batches: ``sort_batches`` as the job has it)."""
    import numpy as np
    import torch
    from torch.nn import functional as F

    from models.finetuned import FinetuneModel, HeadConfig, batch_bytes
    from models.mlstm import MLSTM
    from models.mlstm import preset as preset_config
    from models.text import encode
    from tasks.finetune.train import epoch_batches
    from tasks.pretrain.step import optimizer_step

    torch.manual_seed(0)
    lm = MLSTM(preset_config(preset))
    optimizer = torch.optim.Adam(lm.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    rows = torch.randint(0, 256, (batch_size, 257))
    state = lm.zero_state(batch_size)

    def pretrain_step() -> int:
        nonlocal state
        _, state, _ = optimizer_step(
            lm, optimizer, scaler, rows[:, :-1], rows[:, 1:], state, dtype=torch.float32, clip=1.0
        )
        return batch_size * 256

    model = FinetuneModel(lm, HeadConfig(max_bytes=max_bytes))
    tuner = torch.optim.Adam(model.parameters(), lr=1e-4)
    lengths_N = np.array([min(len(encode(text)), max_bytes) for text in texts])
    order = epoch_batches(lengths_N, batch_size, seed=0, epoch=0, group=sort_batches)
    batches = [[texts[r] for r in rows] for rows in order]

    def finetune_step(index: int) -> int:
        bytes_BT, lengths_B = batch_bytes(batches[index % len(batches)], max_bytes, "front")
        z_B, _ = model(bytes_BT, lengths_B)
        F.binary_cross_entropy_with_logits(z_B, torch.ones_like(z_B)).backward()
        tuner.step()
        tuner.zero_grad(set_to_none=True)
        return int(lengths_B.sum())

    speeds = {}
    for name, step in (("pretrain", lambda i: pretrain_step()), ("finetune", finetune_step)):
        step(0)  # warm-up
        started, chars = time.perf_counter(), 0
        for index in range(1, steps + 1):
            chars += step(index)
        speeds[f"{name}_chars_per_s"] = chars / (time.perf_counter() - started)
    speeds["finetune_vs_pretrain"] = speeds["finetune_chars_per_s"] / speeds["pretrain_chars_per_s"]
    # The share of a fine-tuning epoch's steps that read padding, in the job's batches and in random ones.
    for name, group in (("padding", sort_batches), ("padding_random", 1)):
        rows_SB = epoch_batches(lengths_N, batch_size, seed=0, epoch=0, group=group)
        speeds[name] = 1 - lengths_N[rows_SB].sum() / (lengths_N[rows_SB].max(axis=1) * batch_size).sum()
    return speeds


def compare(spec: str, checkpoint: str, settings_of_tuning: dict[str, Any]) -> dict[str, Any]:
    """Probe, baseline and fine-tuning on one dataset from one checkpoint."""
    from tasks.finetune.config import FinetuneParams
    from tasks.finetune.stage import baseline, frozen_probe, plan_job
    from tasks.finetune.train import fit
    from tasks.jobs.world import World
    from tasks.settings import get_settings

    settings = get_settings()
    params = FinetuneParams(checkpoint=checkpoint, dataset=spec, run="bench", **settings_of_tuning)
    job = plan_job(params, settings)
    started = time.perf_counter()
    probe = frozen_probe(job, settings)
    probe_seconds = time.perf_counter() - started
    started = time.perf_counter()
    measured = baseline(job, settings)
    baseline_seconds = time.perf_counter() - started
    started = time.perf_counter()
    config = job.config.model_copy(update={"tracking": "off"})
    with contextlib.redirect_stdout(sys.stderr):  # the job's log lines: stdout is --json's
        tuned = fit(config, World(), settings)
    finished(tuned["preempted"], tuned["steps"], "fine-tuning")
    tune_seconds = time.perf_counter() - started
    return {
        "dataset": job.dataset_name,
        "probe_test_accuracy": probe.test_accuracy,
        "probe_dev_accuracy": probe.dev_accuracy,
        "probe_seconds": probe_seconds,
        "baseline_test_accuracy": measured.test_accuracy,
        "baseline_seconds": baseline_seconds,
        "finetune_test_accuracy": tuned["test_accuracy"],
        "finetune_dev_accuracy": tuned["dev_accuracy"],
        "finetune_best_epoch": tuned["best_epoch"],
        "finetune_seconds": tune_seconds,
        "finetune_test_seconds": tuned["test_seconds"],  # of finetune_seconds: the job's read of test
        "epochs": [
            {k: e[k] for k in ("epoch", "train_loss", "aux_lm_loss", "dev_accuracy", "lr")}
            for e in tuned["epochs"]
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--checkpoint", help="A pretraining checkpoint. Default: pretrain one (--pretrain).")
    parser.add_argument(
        "--pretrain",
        default="tiny:300",
        type=preset_steps,
        metavar="PRESET:STEPS",
        help="The checkpoint pretrained here: tiny on the demo's sample, any other preset on the shared "
        "Amazon reviews. [tiny:300, the demo's]",
    )
    parser.add_argument("--dataset", action="append", metavar="NAME=PATH", help="Default: the shared SST.")
    parser.add_argument("--train-rows", type=int, default=0, help="Train rows kept (0: all). [0]")
    import pydantic

    from models.precision import PRECISION_CHOICES
    from tasks.finetune.config import FinetuneSettings

    # The command's own defaults: what a user who names none fine-tunes with.
    default = {name: field.default for name, field in FinetuneSettings.model_fields.items()}
    parser.add_argument("--epochs", type=int, default=default["epochs"])
    parser.add_argument("--batch-size", type=int, default=default["batch_size"])
    parser.add_argument("--lr", type=float, default=default["lr"])
    parser.add_argument("--pool", default=default["pool"], choices=("last", "mean", "max", "concat"))
    parser.add_argument("--head", default=default["head"], choices=("linear", "mlp"))
    parser.add_argument("--aux-lm-weight", type=float, default=default["aux_lm_weight"])
    parser.add_argument("--lm-lr-factor", type=float, default=default["lm_lr_factor"])
    parser.add_argument("--freeze-lm", action="store_true", help="Train the head only.")
    parser.add_argument("--max-bytes", type=int, default=512)
    parser.add_argument(
        "--precision",
        default=default["precision"],
        choices=PRECISION_CHOICES,
        help="Fine-tuning's products and the probe's features (auto: fp32 on a CPU). [auto]",
    )
    parser.add_argument("--sort-batches", type=int, default=default["sort_batches"])
    parser.add_argument("--speed-presets", default="tiny,small", help="Presets whose step speeds are timed.")
    parser.add_argument("--speed-steps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="Print the results as JSON on stdout.")
    add_record_option(parser)
    args = parser.parse_args(argv)
    import torch

    tuning = {
        "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "pool": args.pool,
        "head": args.head, "aux_lm_weight": args.aux_lm_weight, "max_bytes": args.max_bytes,
        "freeze_lm": args.freeze_lm, "sort_batches": args.sort_batches, "lm_lr_factor": args.lm_lr_factor,
    } | ({"precision": args.precision} if args.precision != "auto" else {})  # fmt: skip
    try:  # the command's own checks, before minutes of pretraining
        FinetuneSettings(**tuning)
    except pydantic.ValidationError as error:
        parser.error(
            "; ".join(
                f"--{'-'.join(map(str, e['loc'])).replace('_', '-')} {e['input']}: {e['msg']}"
                for e in error.errors()
            )
        )
    rows: list[dict[str, Any]] = []
    speeds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlstm-bench-finetune-") as scratch:
        home = Path(scratch) / "home"
        os.environ["MLSTM_HOME"] = str(home)
        pretrain_seconds = None
        checkpoint, pretrained = args.checkpoint, args.checkpoint
        if checkpoint is None:
            preset, steps = args.pretrain
            say(f"pretraining {preset} for {steps} steps")
            checkpoint, pretrained, pretrain_seconds = pretrained_checkpoint(home, preset, steps)
        texts: list[str] = []
        for spec in args.dataset or DEFAULT_DATASETS:
            name = spec.partition("=")[0]
            data, counts = subsample(spec, args.train_rows or None, Path(scratch) / "data" / name)
            kept = " (a subsample)" if args.train_rows else ""
            say(f"{name}: train {counts['train']:,}{kept}, dev {counts['dev']:,}, test {counts['test']:,}")
            row = {**compare(data, checkpoint, tuning), "rows": counts}
            rows.append(row)
            say(
                f"  test accuracy: fine-tuned {row['finetune_test_accuracy']:.4f} ({row['finetune_seconds']:.0f} s), "
                f"probe {row['probe_test_accuracy']:.4f} ({row['probe_seconds']:.0f} s), TF-IDF "
                f"{row['baseline_test_accuracy']:.4f} ({row['baseline_seconds']:.0f} s)"
            )
            if not texts:
                from tasks.transfer.datasets import load_dataset

                texts = load_dataset(data).train.texts
        for preset in filter(None, args.speed_presets.split(",")):
            say(f"step speeds of {preset}")
            measured = step_speeds(
                preset, args.batch_size, texts, steps=args.speed_steps, max_bytes=args.max_bytes,
                sort_batches=args.sort_batches,
            )  # fmt: skip
            speeds.append({"preset": preset, "batch_size": args.batch_size, **measured})
            say(
                f"  fine-tuning {measured['finetune_chars_per_s']:,.0f} chars/s, pretraining "
                f"{measured['pretrain_chars_per_s']:,.0f} chars/s ({measured['finetune_vs_pretrain']:.2f}×)"
            )
    results = {
        "machine": machine(torch.device("cpu")),
        "checkpoint": pretrained,
        "pretrain_seconds": pretrain_seconds,
        "settings": tuning,
        "rows": rows,
        "speeds": speeds,
    }
    print_table(results)
    if args.json:
        print(json.dumps(results, indent=2))
    record("finetune", args.record, results, argv=argv)


def print_table(results: dict[str, Any]) -> None:
    say("| dataset | fine-tuned | probe | TF-IDF | seconds (fine-tune / probe / TF-IDF) |")
    for r in results["rows"]:
        say(
            f"| {r['dataset']} | {r['finetune_test_accuracy']:.2%} | {r['probe_test_accuracy']:.2%} | "
            f"{r['baseline_test_accuracy']:.2%} | {r['finetune_seconds']:.0f} / {r['probe_seconds']:.0f} / "
            f"{r['baseline_seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
