"""A job for the launchers' end-to-end tests, run by torchrun as ``-m slurm_probe_job``.

Default: every rank all-reduces ``rank + 1`` over gloo and prints the sum. ``--sleep S``: sleeps
instead, and says so when SIGTERM stops it (to be cancelled). ``--fail CODE``: exits with that code.
``--marker`` is only there to be found in the process table.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def _stop(rank: int) -> None:
    # What the training job does on SIGTERM: write a checkpoint, then leave.
    print(f"probe rank {rank} got SIGTERM", flush=True)
    sys.exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fail", type=int, default=0)
    parser.add_argument("--marker", default="")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"probe rank {rank}/{world_size} started", flush=True)
    if args.fail:
        print(f"probe rank {rank} failing with {args.fail}", flush=True)
        sys.exit(args.fail)
    if args.sleep:
        signal.signal(signal.SIGTERM, lambda *_: _stop(rank))
        time.sleep(args.sleep)
        return

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        print(f"probe rank {rank}/{world_size} sum {total.item():g}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
