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

Each row also says how many passes it made over what it read fresh (the base run the base's train
split, (a) the grown corpus's, (b) and (c) the delta's). Each is scored in bits per byte on three val
splits read whole from a zero state: the grown corpus's (``full val``), the delta's alone and the base's
alone (where (c) forgets). Seconds are each run's wall time in this process, comparable within the run
only. The goal (issue 52): (b) within 2% of (a)'s bits
per byte on the full val split at no more than 15% of (a)'s steps.

    PYTHONPATH=. .venv/bin/python benchmarks/continue.py                  # a few minutes on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/continue.py --steps 60 --batch 20  # a smoke run (5% of 20 rows: one replayed)
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, add_record_option, machine, new_parser, record, say  # the working tree on the path

from tasks.corpus.build import CorpusConfig, build_in_process, plan_corpus
from tasks.jobs.checkpoint import load_checkpoint
from tasks.jobs.world import World
from tasks.pipeline import PipelineParams
from tasks.pretrain.config import TrainConfig
from tasks.pretrain.mix import replay_rows
from tasks.pretrain.stream import open_split
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


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument(
        "--delta", default="Magazine_Subscriptions_5.json.gz", help="The Amazon file that is the delta."
    )
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="The model's size.")
    parser.add_argument("--steps", type=int, default=400, help="Steps of the base run and of (a).")
    parser.add_argument("--share", type=float, default=0.15, help="(b) and (c)'s steps, a share of --steps.")
    parser.add_argument("--replay", type=float, default=0.05, help="(b)'s replay share.")
    parser.add_argument("--batch", type=int, default=64, help="Rows a step (--replay needs ≥ 0.5 / it).")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument(
        "--continued-lr", type=float, help="(b) and (c)'s peak learning rate, re-warmed to (default: --lr)."
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
        # Each case: its settings, and the train split it reads fresh with the rows a step that read it.
        replayed = len(replay_rows(args.batch, args.replay, seed=0))  # the job's own count of replay rows
        cases = {
            "base": ({"corpus": base, "total_steps": args.steps}, "base", args.batch),
            "(a) scratch": ({"corpus": full, "total_steps": args.steps}, "full", args.batch),
            "(b) continued, replay": (
                {"corpus": full, "total_steps": continued_steps, "replay": args.replay},
                "delta",
                args.batch - replayed,
            ),
            "(c) continued, no replay": (
                {"corpus": full, "total_steps": continued_steps},
                "delta",
                args.batch,
            ),
        }
        train_bytes = {
            name: json.loads(Path(uri).read_text())["splits"]["train"]["text_bytes"]
            for name, uri in (("full", full), ("delta", delta), ("base", base))
        }
        vals = {
            name: open_split(uri, "val", root / "cache")
            for name, uri in (("full", full), ("delta", delta), ("base", base))
        }
        rows = []
        parent = None
        handler = signal.getsignal(signal.SIGTERM)
        for name, (settings_of, split_of, fresh_rows) in cases.items():
            if name.startswith("(b)") or name.startswith("(c)"):
                settings_of = {
                    **settings_of,
                    "init_from": parent,
                    # The weekly run's own warm-up: a share of the continued run's steps.
                    "warmup_steps": 0,
                    "warmup_share": PipelineParams.model_fields["continued_warmup"].default,
                    "lr": args.continued_lr or args.lr,
                }
            config = TrainConfig(run_name=name.split()[0].strip("()"), **{**common, **settings_of})
            say(f"training {name}: {config.total_steps} steps")
            started = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):  # the job's log lines: stdout is the JSON's
                    result = fit(config, World(), settings)
            finally:
                signal.signal(signal.SIGTERM, handler)
            seconds = time.perf_counter() - started
            if name == "base":
                parent = result.checkpoint_uri
            model = load_checkpoint(str(result.checkpoint_uri)).model()
            bits = {
                split: bits_per_byte(model, stream, args.batch, args.seq_len)
                for split, stream in vals.items()
            }
            passes = result.steps * fresh_rows * args.seq_len / train_bytes[split_of]
            rows.append(
                {
                    "case": name,
                    "steps": result.steps,
                    "seconds": seconds,
                    "fresh_passes": passes,
                    "val_bpb": bits,
                }
            )
            say(f"  {name}: {result.steps} steps in {seconds:.1f} s, val bpb {bits}")
        sizes = {name: len(stream) for name, stream in vals.items()}
    scratch_row, replay_row = rows[1], rows[2]
    results = {
        "settings": {**vars(args), "continued_steps": continued_steps, "source_bytes": shares},
        "val_bytes": sizes,
        "train_bytes": train_bytes,
        "rows": rows,
        "goal": {
            "bpb_ratio": replay_row["val_bpb"]["full"] / scratch_row["val_bpb"]["full"],
            "steps_ratio": replay_row["steps"] / scratch_row["steps"],
        },
        "machine": machine(torch.device("cpu")),
    }
    print(json.dumps(results, indent=2))
    record("continue", args.record, results, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
