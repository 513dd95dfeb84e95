#!/usr/bin/env python
"""Step time and peak memory per rank for each ``--sharding``, against DDP (``none``) in the same run.

``benchmarks/pretrain.py --sharding S[,S…]`` runs this: one torchrun of W ranks per sharding, each
rank timing the job's own step (``tasks.pretrain.step.optimizer_step`` on the model
``tasks.jobs.sharding.wrap`` gives it) on random bytes, B/W rows each. Peak memory is the CUDA
allocator's peak on a GPU and the process's peak resident set on a CPU (which includes Python and
torch themselves, ≈ the same for every row); optimizer bytes are the Adam state this rank holds.

    PYTHONPATH=. .venv/bin/python benchmarks/pretrain.py --sharding none,optimizer,full --presets small --nproc 2
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
STACKS_AFTER_ENV = "MLSTM_BENCH_STACKS_AFTER_S"


def worker(
    preset_name: str, sharding: str, batch: int, seq_len: int, steps: int, warmup: int, out: Path
) -> None:
    """One rank's measurement (run under torchrun)."""
    from models.mlstm import MLSTM, preset
    from tasks.jobs.config import OptimizerSettings
    from tasks.jobs.sharding import optimizer_state_bytes, wrap
    from tasks.jobs.world import World
    from tasks.pretrain.step import optimizer_step

    world = World.from_env(group=sharding == "full")
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = MLSTM(preset(preset_name)).to(world.device)
    module, optimizer = wrap(
        model,
        sharding,
        world_size=world.size,
        device=world.device,
        dtype=dtype,
        optimizer=OptimizerSettings(),
        lr=5e-4,
    )  # type: ignore[arg-type]
    scaler = torch.amp.GradScaler(world.device.type, enabled=False)
    rows = batch // world.size
    state = model.zero_state(rows)
    generator = torch.Generator().manual_seed(world.rank)
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(warmup + steps):
        data = torch.randint(0, 256, (rows, seq_len + 1), generator=generator).to(world.device)
        world.barrier()
        start = time.perf_counter()
        _, state, _ = optimizer_step(
            module, optimizer, scaler, data[:, :-1], data[:, 1:], state, dtype=dtype, clip=1.0
        )
        if world.device.type == "cuda":
            torch.cuda.synchronize()
        world.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    peak = (
        torch.cuda.max_memory_allocated()
        if world.device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    result = {
        "rank": world.rank,
        "step_s": sorted(times)[len(times) // 2],
        "peak_bytes": peak,
        "optimizer_bytes": optimizer_state_bytes(optimizer),
        "weight_bytes": sum(t.numel() * t.element_size() for t in local),
    }
    gathered: list[Any] = [None] * world.size
    if world.size > 1:
        dist.all_gather_object(gathered, result)
    else:
        gathered = [result]
    if world.is_main:
        out.write_text(json.dumps(gathered))
    # The wrapped module and its optimizer hold the process group: freed here, before it is destroyed,
    # not at interpreter exit after it, where a rank was seen to hang once its work was done (its only
    # frame the call of worker(), a C thread beside it) until the launch's timeout.
    del module, optimizer, model, state, local
    world.close()


def measure(preset_name: str, sharding: str, args: Any) -> dict[str, Any]:
    """Launch W ranks for one sharding; the slowest rank's step and the largest rank's memory."""
    from tasks.jobs.launchers.local import loopback_env, loopback_rendezvous
    from tasks.processes import stop_group

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ranks.json"
        # Launched as the local launcher launches a job: every socket on loopback.
        command = [
            sys.executable, "-m", "torch.distributed.run", *loopback_rendezvous(Path(folder) / "job.rendezvous"),
            f"--nproc-per-node={args.nproc}",
            __file__, "--worker", preset_name, sharding, str(args.batch), str(args.seq_len), str(args.steps),
            str(args.warmup), str(out),
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            STACKS_AFTER_ENV: str(max(1.0, args.timeout - 5)),
            **loopback_env(),
        }
        process = subprocess.Popen(
            command,
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own group: a hung rendezvous or collective is stopped whole
        )
        try:
            _, stderr = process.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            stop_group(process, grace=10)
            _, stderr = process.communicate()
            raise RuntimeError(
                f"--sharding {sharding}: {args.nproc} ranks gave no result in {args.timeout:.0f} s "
                f"(stopped); torchrun's stderr ends: {_tail(stderr)}"
            ) from None
        if process.returncode != 0:
            raise RuntimeError(
                f"--sharding {sharding}: torchrun exited with {process.returncode}; its stderr ends: {_tail(stderr)}"
            )
        ranks = json.loads(out.read_text())
    return {
        "preset": preset_name,
        "sharding": sharding,
        "ranks": args.nproc,
        "batch": args.batch,
        "step_s": max(r["step_s"] for r in ranks),
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "optimizer_bytes": max(r["optimizer_bytes"] for r in ranks),
        "weight_bytes": max(r["weight_bytes"] for r in ranks),
    }


def _tail(stderr: bytes, lines: int = 80) -> str:
    return "\n".join(stderr.decode(errors="replace").strip().splitlines()[-lines:]) or "(nothing)"


def report(rows: list[dict[str, Any]], machine: dict[str, Any]) -> None:
    """The table, each row against its preset's ``none`` (DDP) row measured in the same run."""
    print(f"machine: {machine.get('cpu', machine)}")
    header = f"{'preset':<12} {'sharding':<10} {'ranks':>5} {'step ms':>9} {'× ddp':>6} {'peak MiB/rank':>14} {'weights MiB/rank':>17} {'Adam MiB/rank':>14} {'× ddp':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        base = next(
            r
            for r in rows
            if r["preset"] == row["preset"] and r.get("batch") == row.get("batch") and r["sharding"] == "none"
        )
        mib = 1024**2
        print(
            f"{row['preset']:<12} {row['sharding']:<10} {row['ranks']:>5} {row['step_s'] * 1e3:>9.1f} "
            f"{row['step_s'] / base['step_s']:>6.2f} {row['peak_bytes'] / mib:>14.0f} {row['weight_bytes'] / mib:>17.1f} "
            f"{row['optimizer_bytes'] / mib:>14.1f} {row['optimizer_bytes'] / base['optimizer_bytes']:>6.2f}"
        )


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    name, shard, batch, seq_len, steps, warmup, out = sys.argv[2:9]
    if dump_after := os.environ.get(STACKS_AFTER_ENV):
        # A rank still here just before the launch is stopped prints where it waits: the hang's cause.
        faulthandler.dump_traceback_later(float(dump_after), exit=False)
    worker(name, shard, int(batch), int(seq_len), int(steps), int(warmup), Path(out))
