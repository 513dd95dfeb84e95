"""ASHA against random search over the same trials: best val_bpc reached against training steps spent.

For each seed, one sweep of the pretraining job (tiny preset, the shared Amazon corpus) runs with ASHA:
trials are compared at each rung and the top 1/eta go on, resuming their runs. Random search trains
the *same* trials (the same sampler, seed and trial numbers draw the same settings) each to the full
budget. Because a promoted trial resumes exactly where it stopped (tests/test_sweep.py holds its final
loss equal to a straight run's), random search's runs are ASHA's runs continued to the end: the
benchmark trains the pruned trials on to ``max_steps`` after the sweep instead of training all again.

Reported per seed: steps each arm trained, the best val_bpc each reached, and the steps each needed to
reach the same val_bpc (the worse of the two bests), in the order the trials ran; and the ratio.

    .venv/bin/python benchmarks/sweep.py                       # 3 seeds × 6 trials, rungs 3, 9, 27
    .venv/bin/python benchmarks/sweep.py --seeds 1 --max-steps 9 --min-steps 1    # a quick look
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, add_record_option, describe, machine, new_parser, record, say

sys.path.insert(0, str(REPO / "tests"))


def build_corpus(root: Path, data: Path) -> str:
    from corpus_helpers import build

    from tasks.corpus.build import CorpusConfig

    files = sorted((data / "amazon").glob("*.gz"))
    if not files:
        raise SystemExit(f"no Amazon files in {data / 'amazon'}: pass --data with the shared data folder")
    manifest = build(files, root / "store", CorpusConfig(split=(98, 1, 1)))
    return str(root / "store" / "corpora" / manifest["corpus_id"] / "manifest.json")


def launch_in_process(settings: Any) -> Any:
    """The job's own ``fit`` in this process (one rank): the same training as under torchrun, without
    a torchrun start per launch, which on two cores costs more than the tiny model's steps."""
    from tasks.pretrain.config import PretrainParams
    from tasks.pretrain.stage import plan_job
    from tasks.pretrain.train import fit
    from tasks.pretrain.world import World

    def launch(params: PretrainParams) -> dict[str, Any]:
        config = plan_job(params, settings).config
        with contextlib.redirect_stdout(io.StringIO()):
            return fit(config, World(), settings)

    return launch


class Ledger:
    """Each launch in order: (trial run, steps trained, the sweep's best finished val_bpc so far)."""

    def __init__(self, launch: Any) -> None:
        self.launch, self.rows, self.steps = launch, [], 0
        self.trained: dict[str, int] = {}

    def __call__(self, params: Any) -> dict[str, Any]:
        result: dict[str, Any] = self.launch(params)
        self.steps += result["steps"] - self.trained.get(params.run, 0)
        self.trained[params.run] = result["steps"]
        self.rows.append((params.run, self.steps, result["steps"], result["val_bpc"]))
        return result


def steps_to_reach(points: list[tuple[int, float]], target: float) -> int | None:
    """The first cumulative step count at which the best value so far is at or below ``target``."""
    return next((steps for steps, best in points if best <= target + 1e-12), None)


def one_seed(seed: int, args: Any, corpus: str, home: Path) -> dict[str, Any]:
    from tasks.settings import Settings
    from tasks.sweep.engine import Sweep
    from tasks.sweep.spec import parse_spec

    settings = Settings(home=home / f"seed-{seed}", store_uri=str(home / f"seed-{seed}" / "store"))
    spec = parse_spec(
        {
            "corpus": corpus, "preset": "tiny", "seq_len": args.seq_len, "log_every": 1000,
            "budget": {"trials": args.trials, "max_steps": args.max_steps},
            "asha": {"min_steps": args.min_steps, "eta": args.eta},
            "sampler": "random", "seed": seed,
            "space": {"lr": {"log_uniform": [1e-4, 3e-2]}, "batch_size": {"choice": [16, 32]}},
        }
    )  # fmt: skip
    ledger = Ledger(launch_in_process(settings))
    started = time.perf_counter()
    result = Sweep(spec, settings, ledger).run()
    asha_seconds = time.perf_counter() - started
    top = max(spec.rungs())
    # ASHA: the best *finished* trial so far, after each launch.
    asha_points, best = [], float("inf")
    for _, steps, at, value in ledger.rows:
        if at == top:
            best = min(best, value)
        asha_points.append((steps, best))
    asha_steps = result["steps_trained"]
    # Random search: the same trials, each to the end, in trial order; pruned ones resumed to the end.
    finals = {}
    for row in result["trials"]:
        if row["steps"] < top:
            params = spec.trial_params(_values(result, row["trial"], settings), row["run"], top)
            finals[row["trial"]] = ledger(params)["val_bpc"]
        else:
            finals[row["trial"]] = row["value"]
    random_points, best = [], float("inf")
    for number in sorted(finals):
        best = min(best, finals[number])
        random_points.append(((number + 1) * top, best))
    asha_best, random_best = asha_points[-1][1], random_points[-1][1]
    target = max(asha_best, random_best)
    asha_to = steps_to_reach(asha_points, target)
    random_to = steps_to_reach(random_points, target)
    return {
        "seed": seed,
        "trials": args.trials,
        "rungs": spec.rungs(),
        "asha_steps": asha_steps,
        "asha_best": asha_best,
        "asha_seconds": round(asha_seconds, 1),
        "random_steps": args.trials * top,
        "random_best": random_best,
        "target_val_bpc": target,
        "asha_steps_to_target": asha_to,
        "random_steps_to_target": random_to,
        "pruned": sum(r["state"] == "pruned" for r in result["trials"]),
    }


def _values(result: dict[str, Any], number: int, settings: Any) -> dict[str, Any]:
    from tasks.sweep.engine import load_study

    study = load_study(result["sweep_id"], settings)
    values: dict[str, Any] = study.trials[number].user_attrs["values"]
    return values


def main() -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="the shared data")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=27)
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--eta", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    add_record_option(parser)
    args = parser.parse_args()

    import os

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import optuna
    import torch

    info = machine(torch.device("cpu"), optuna=optuna.__version__)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        home = Path(tmp)
        os.environ["MLSTM_HOME"] = str(home)  # MLflow's database and the shard cache: thrown away after
        corpus = build_corpus(home / "corpus", args.data)
        for seed in range(args.seeds):
            say(f"seed {seed}: ASHA sweep of {args.trials} trials, then the pruned ones to the end")
            rows.append(one_seed(seed, args, corpus, home))
    settings = {k: getattr(args, k) for k in ("seeds", "trials", "max_steps", "min_steps", "eta", "seq_len")}
    record("sweep", args.record, {"machine": info, "settings": settings, "rows": rows})
    if args.json:
        print(json.dumps({"machine": info, "rows": rows}, indent=2))
        return
    print(f"ASHA vs random search, same trials (tiny preset, rungs {rows[0]['rungs']}, eta {args.eta}) "
          f"on {describe(info)}")  # fmt: skip
    header = (
        "| seed | pruned | ASHA steps | random steps | ASHA best | random best | same val_bpc | "
        "ASHA steps to it | random steps to it | random / ASHA |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for r in rows:
        ratio = (
            f"{r['random_steps_to_target'] / r['asha_steps_to_target']:.2f}×"
            if r["asha_steps_to_target"] and r["random_steps_to_target"]
            else "-"
        )
        print(
            f"| {r['seed']} | {r['pruned']}/{r['trials']} | {r['asha_steps']} | {r['random_steps']} | "
            f"{r['asha_best']:.4f} | {r['random_best']:.4f} | {r['target_val_bpc']:.4f} | "
            f"{r['asha_steps_to_target']} | {r['random_steps_to_target']} | {ratio} |"
        )
    total_asha = sum(r["asha_steps"] for r in rows)
    total_random = sum(r["random_steps"] for r in rows)
    print(f"\nall seeds: ASHA trained {total_asha} steps, random search {total_random} "
          f"({total_random / total_asha:.2f}× as many)")  # fmt: skip


if __name__ == "__main__":
    main()
