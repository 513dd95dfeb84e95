#!/usr/bin/env python
"""Continued pretraining against training anew, in one run: what a week's delta costs.

The corpus is the shared Amazon files: the *base* is every file but ``--delta``, the *delta* that file
(a category the base lacks), the *grown* corpus a manifest listing the base's shards and the delta's, as
``corpus build --base`` makes one. The default delta, ``Magazine_Subscriptions_5``, is 6% of the sources'
bytes and 6% of the grown corpus's train text, a week's growth as issue 52 sizes it; a file whose text
is mostly duplicates (``AMAZON_FASHION_5``: 4% of the bytes, 0.6% of the text after dedup) makes (b)
read its few rows several times over, which measures over-training on a sliver, not continuing. The
base run trains ``--preset`` from its seed for ``--steps`` on the base; then, each from that point:

- (a) scratch: from its seed on the grown corpus, ``--steps`` steps (what a weekly rebuild pays today);
- (b) continued: from the base run's checkpoint on the delta with ``--replay`` of the base, ``--share``
  of (a)'s steps, its learning rate re-warmed over the weekly run's share of them (``continued_warmup``:
  a tenth) to ``--continued-lr`` (default ``--lr``) and decayed again (``pretrain --init-from …
  --replay … --warmup-share … --lr …``);
- (c) continued without replay: as (b), every row on the delta.

``--replay`` and ``--continued-lr`` take several values: (b) then runs once for each pair, every one
from the same base checkpoint, and the one with the lowest bits per byte on the full val split is
*chosen* (the val splits are this benchmark's dev data); (c) runs at the chosen rate. Each row also says
how many passes it made over what it read fresh (the base run the base's train split, (a) the grown
corpus's, (b) and (c) the delta's). Each is scored in bits per byte on three val splits read whole from a
zero state: the grown corpus's (``full val``), the delta's alone and the base's alone (where (c) forgets).
Then, once, at the end, the base, (a), the chosen (b) and (c) are scored on the three test splits, which
no choice has seen. Seconds are each run's wall time in this process, comparable within the run only.
The goal (issue 52): (b) within 2% of (a)'s bits per byte on the full val split at no more than 15% of
(a)'s steps.

    PYTHONPATH=. .venv/bin/python benchmarks/continue.py                  # a few minutes on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/continue.py --steps 60 --batch 20  # a smoke run (5% of 20 rows: one replayed)
    PYTHONPATH=. .venv/bin/python benchmarks/continue.py --replay 0.05 0.5 --continued-lr 0.003 0.001  # four (b)s
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO, add_record_option, machine, new_parser, record, say  # the working tree on the path

from tasks.corpus.build import CorpusConfig, build_in_process, plan_corpus
from tasks.jobs.checkpoint import load_checkpoint
from tasks.jobs.world import World
from tasks.pipeline import PipelineParams
from tasks.pretrain.config import TrainConfig
from tasks.pretrain.mix import replay_rows
from tasks.pretrain.stream import ByteStream, StreamError, open_split
from tasks.pretrain.train import bits_per_byte, fit
from tasks.settings import get_settings
from tasks.store import LocalStore

# The shared data beside the checkout (MLSTM_SHARED_DIR overrides, as in the tests).
AMAZON = Path(os.environ.get("MLSTM_SHARED_DIR", REPO.parent / "shared")) / "data" / "amazon"


def build(sources: list[Path], store: Path, split: tuple[int, int, int]) -> str:
    manifest = build_in_process(
        plan_corpus([str(s) for s in sources], CorpusConfig(split=split)), LocalStore(store)
    )
    return str(store / "corpora" / manifest.corpus_id / "manifest.json")


def grown(base_uri: str, delta_uri: str, out: Path) -> str:
    """A manifest listing the base's shards (the same files' bytes) and the delta's, in a folder of its own."""
    base, delta = (json.loads(Path(uri).read_text()) for uri in (base_uri, delta_uri))
    manifest = copy.deepcopy(base)
    manifest["corpus_id"] = f"{base['corpus_id'][:8]}{delta['corpus_id'][:8]}"
    for split, entry in manifest["splits"].items():
        entry["shards"] = []
        for origin, uri, source in (("base", base_uri, base), ("delta", delta_uri, delta)):
            for shard in source["splits"][split]["shards"]:
                (out / origin / shard["path"]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(uri).parent / shard["path"], out / origin / shard["path"])
                entry["shards"].append({**shard, "path": f"{origin}/{shard['path']}"})
        for total in ("rows", "bytes", "text_bytes"):
            entry[total] = sum(shard[total] for shard in entry["shards"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    return str(out / "manifest.json")


def score(checkpoint: str, splits: dict[str, ByteStream], rows: int, seq_len: int) -> dict[str, float]:
    """A checkpoint's bits per byte on each split, read whole from a zero state by ``rows`` rows."""
    model = load_checkpoint(checkpoint).model()
    return {name: bits_per_byte(model, stream, rows, seq_len) for name, stream in splits.items()}


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument(
        "--delta", default="Magazine_Subscriptions_5.json.gz", help="The Amazon file that is the delta."
    )
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="The model's size.")
    parser.add_argument("--steps", type=int, default=400, help="Steps of the base run and of (a).")
    parser.add_argument("--share", type=float, default=0.15, help="(b) and (c)'s steps, a share of --steps.")
    parser.add_argument(
        "--replay", type=float, nargs="+", default=[0.05], help="(b)'s replay share (several: one (b) each)."
    )
    parser.add_argument("--batch", type=int, default=64, help="Rows a step (--replay needs ≥ 0.5 / it).")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument(
        "--continued-lr",
        type=float,
        nargs="+",
        help="(b) and (c)'s peak learning rate, re-warmed to (default: --lr; several: one (b) each).",
    )
    # A val split large enough to score the delta alone on (at 98/1/1 the delta's is about 1 KB).
    parser.add_argument("--split", default="90,5,5", help="The corpora's train,val,test shares.")
    add_record_option(parser)
    args = parser.parse_args(argv)
    files = sorted(AMAZON.glob("*.gz"))
    delta_file = AMAZON / args.delta
    base_files = [f for f in files if f != delta_file]
    shares = {"base": sum(f.stat().st_size for f in base_files), "delta": delta_file.stat().st_size}
    continued_steps = max(1, round(args.share * args.steps))
    # Each share's replayed rows, as the job counts them: a share that rounds to no row is refused here,
    # before an hour of base and scratch runs, not after.
    try:
        replayed = {replay: len(replay_rows(args.batch, replay, seed=0)) for replay in args.replay}
    except StreamError as error:
        parser.error(str(error))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-continue-") as scratch:
        root = Path(scratch)
        settings = get_settings(home=root / "home")
        say(f"building the base ({len(base_files)} files) and the delta ({args.delta})")
        split = tuple(int(part) for part in args.split.split(","))
        assert len(split) == 3, "--split: train,val,test"
        base = build(base_files, root / "base", split)  # type: ignore[arg-type]
        delta = build([delta_file], root / "delta", split)  # type: ignore[arg-type]
        full = grown(base, delta, root / "grown")
        common = {
            "preset": args.preset, "batch_size": args.batch, "seq_len": args.seq_len, "lr": args.lr,
            "store": str(root / "runs"), "tracking": "off", "checkpoint_every": 10**6, "val_every": 10**6,
            "val_steps": 1, "log_every": 10**6,
        }  # fmt: skip
        corpora = {"full": full, "delta": delta, "base": base}
        train_bytes = {
            name: json.loads(Path(uri).read_text())["splits"]["train"]["text_bytes"]
            for name, uri in corpora.items()
        }
        vals = {name: open_split(uri, "val", root / "cache") for name, uri in corpora.items()}
        sizes = {name: len(stream) for name, stream in vals.items()}
        handler = signal.getsignal(signal.SIGTERM)
        checkpoints: dict[str, str] = {}

        def run(name: str, settings_of: dict[str, Any], split_of: str, fresh_rows: int) -> dict[str, Any]:
            """Train one case, score it on the val splits: its row (``split_of``: the train split it reads
            fresh, with ``fresh_rows`` rows a step)."""
            if name.startswith(("(b)", "(c)")):
                settings_of = {
                    **settings_of,
                    "init_from": checkpoints["base"],
                    # The weekly run's own warm-up: a share of the continued run's steps.
                    "warmup_steps": 0,
                    "warmup_share": PipelineParams.model_fields["continued_warmup"].default,
                }
            # base, a, b (b0, b1, … in a grid), c: the names the job's records and checkpoints go under.
            run_name = name.split()[0].strip("()") + (
                str(len(continued)) if name.startswith("(b)") and grid[1:] else ""
            )
            config = TrainConfig(run_name=run_name, **{**common, **settings_of})
            say(f"training {name}: {config.total_steps} steps")
            started = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):  # the job's log lines: stdout is the JSON's
                    result = fit(config, World(), settings)
            finally:
                signal.signal(signal.SIGTERM, handler)
            seconds = time.perf_counter() - started
            checkpoints[name] = str(result.checkpoint_uri)
            bits = score(checkpoints[name], vals, args.batch, args.seq_len)
            say(f"  {name}: {result.steps} steps in {seconds:.1f} s, val bpb {bits}")
            return {
                "case": name,
                "steps": result.steps,
                "seconds": seconds,
                "fresh_passes": result.steps * fresh_rows * args.seq_len / train_bytes[split_of],
                "val_bpb": bits,
            }

        grid = list(itertools.product(args.replay, args.continued_lr or [args.lr]))
        continued: list[dict[str, Any]] = []
        rows = [
            run("base", {"corpus": base, "total_steps": args.steps}, "base", args.batch),
            run("(a) scratch", {"corpus": full, "total_steps": args.steps}, "full", args.batch),
        ]
        for replay, lr in grid:
            name = "(b) continued, replay" + (f" {replay:g}, lr {lr:g}" if len(grid) > 1 else "")
            settings_of = {"corpus": full, "total_steps": continued_steps, "replay": replay, "lr": lr}
            continued.append(
                {**run(name, settings_of, "delta", args.batch - replayed[replay]), "replay": replay, "lr": lr}
            )
        chosen = min(continued, key=lambda row: row["val_bpb"]["full"])  # on the dev data: val
        forgetful = run(
            "(c) continued, no replay",
            {"corpus": full, "total_steps": continued_steps, "lr": chosen["lr"]},
            "delta",
            args.batch,
        )
        rows += [*continued, {**forgetful, "lr": chosen["lr"]}]
        # Test, once, at the end: the runs the goal compares, the chosen (b) among them.
        tests = {name: open_split(uri, "test", root / "cache") for name, uri in corpora.items()}
        for row in (rows[0], rows[1], chosen, rows[-1]):
            row["test_bpb"] = score(checkpoints[row["case"]], tests, args.batch, args.seq_len)
        test_sizes = {name: len(stream) for name, stream in tests.items()}
    anew = rows[1]  # (a)
    results = {
        "settings": {**vars(args), "continued_steps": continued_steps, "source_bytes": shares},
        "val_bytes": sizes,
        "test_bytes": test_sizes,
        "train_bytes": train_bytes,
        "rows": rows,
        "chosen": chosen["case"],
        "goal": {
            "bpb_ratio": chosen["val_bpb"]["full"] / anew["val_bpb"]["full"],
            "test_bpb_ratio": chosen["test_bpb"]["full"] / anew["test_bpb"]["full"],
            "steps_ratio": chosen["steps"] / anew["steps"],
        },
        "machine": machine(torch.device("cpu")),
    }
    print(json.dumps(results, indent=2))
    record("continue", args.record, results, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
