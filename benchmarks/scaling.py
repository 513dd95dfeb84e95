#!/usr/bin/env python
"""A scaling model for data-parallel pretraining on many GPUs: all-reduce bytes per step, their time on the
stated links, how much of it can hide behind the backward pass, and the expected efficiency, beside Puri
et al. (2018)'s 85% (109× on 128 V100s).

Nothing here is measured: the inputs are the model's parameter count (``models.mlstm``), the step time
of one GPU (``--step-seconds``, or the fused row of a ``benchmarks/pretrain.py --json`` report with
``--from-json``, or the step the issue's MFU goal implies) and the link speeds (flags, defaults the
issue's cluster: 16 nodes × 8 H100, NVLink 4 inside a node, one 400 Gb/s InfiniBand NIC per GPU).

The all-reduce is NCCL's hierarchical one: reduce-scatter inside the node over NVLink, an all-reduce of
each GPU's 1/8 share across the nodes over InfiniBand (a ring: 2 (n − 1)/n of the bytes each way), then
an all-gather inside the node. Bandwidth terms only (latency is microseconds against milliseconds).

Overlap: DDP all-reduces a gradient bucket as soon as the backward has made it. The fused recurrence
makes the gradients of W_h and W_mh (most of the parameters) in two products after its backward loop,
so their share cannot hide behind the loop; only the read-out's, made before the loop, can. The model
counts the rest as exposed.

    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py                                 # the issue's goal
    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py --step-seconds 0.335            # main on one H100
    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py --from-json pretrain-h100.json  # a measured step
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common import add_record_option, new_parser, record

from models.mlstm import MLSTMConfig, preset

PAPER_EFFICIENCY = 0.85  # Puri et al. 2018: 109× on 128 V100s
PAPER_GPUS = 128


@dataclass
class Scaling:
    preset: str
    num_params: int
    nodes: int
    gpus_per_node: int
    grad_bytes: int  # per element as all-reduced
    step_seconds: float  # one GPU's step, compute only
    step_source: str
    allreduce_bytes: int  # per GPU per step: the gradients
    nvlink_seconds: float  # reduce-scatter + all-gather inside the node
    infiniband_seconds: float  # all-reduce of a 1/gpus_per_node share across nodes
    allreduce_seconds: float
    overlappable_share: float  # of the bytes, made before the recurrence's backward loop
    exposed_seconds: float
    efficiency: float  # step / (step + exposed)
    speedup: float  # gpus × efficiency
    paper_efficiency: float = PAPER_EFFICIENCY


def overlappable_share(config: MLSTMConfig) -> float:
    """The parameters whose gradients exist before the recurrence's backward loop starts: the read-out."""
    H, V = config.hidden_size, config.vocab_size
    return (H * V + V) / config.num_params


def model(
    name: str,
    *,
    step_seconds: float,
    step_source: str,
    nodes: int,
    gpus_per_node: int,
    nvlink_gbps: float,
    infiniband_gbps: float,
    grad_bytes: int,
) -> Scaling:
    config = preset(name)
    size = config.num_params * grad_bytes
    g, n = gpus_per_node, nodes
    nvlink = 2 * (g - 1) / g * size / (nvlink_gbps * 1e9 / 8) if g > 1 else 0.0
    infiniband = 2 * (n - 1) / n * (size / g) / (infiniband_gbps * 1e9 / 8) if n > 1 else 0.0
    allreduce = nvlink + infiniband
    share = overlappable_share(config)
    # Hidden: the read-out's share, up to the length of the recurrence's backward (most of the step).
    exposed = allreduce * (1 - share) + max(0.0, allreduce * share - step_seconds / 2)
    efficiency = step_seconds / (step_seconds + exposed)
    return Scaling(
        preset=name,
        num_params=config.num_params,
        nodes=n,
        gpus_per_node=g,
        grad_bytes=grad_bytes,
        step_seconds=step_seconds,
        step_source=step_source,
        allreduce_bytes=size,
        nvlink_seconds=nvlink,
        infiniband_seconds=infiniband,
        allreduce_seconds=allreduce,
        overlappable_share=share,
        exposed_seconds=exposed,
        efficiency=efficiency,
        speedup=n * g * efficiency,
    )


def goal_step_seconds(name: str, batch: int, seq_len: int, mfu: float, peak_flops: float) -> float:
    """The step that the issue's MFU goal implies: 6 × params × bytes ÷ (MFU × peak)."""
    return 6 * preset(name).num_params * batch * seq_len / (mfu * peak_flops)


def step_from_report(path: Path, name: str, batch: int) -> tuple[float, str]:
    report = json.loads(path.read_text())
    for row in report["rows"]:
        if (row["preset"], row["impl"], row["batch"]) == (name, "fused", batch) and row["step_seconds"]:
            seconds = sum(row["step_seconds"]) / len(row["step_seconds"])
            where = report["machine"].get("gpu") or report["machine"]["cpu"]
            return seconds, f"measured: {path.name}, {name} fused, batch {batch}, {row['precision']}, {where}"
    raise SystemExit(f"{path}: no fused {name} row at batch {batch} with timed steps")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--preset", default="paper_4096")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    # H100 SXM: NVLink 4 is 900 GB/s per GPU, both directions together: 450 GB/s = 3,600 Gb/s each way.
    parser.add_argument("--nvlink-gbps", type=float, default=3600.0, help="Per GPU, one direction, Gb/s.")
    parser.add_argument("--infiniband-gbps", type=float, default=400.0, help="Per GPU (one NIC each), Gb/s.")
    parser.add_argument("--grad-bytes", type=int, default=4, help="Bytes per gradient element (fp32: 4).")
    parser.add_argument("--batch", type=int, default=256, help="Rows per GPU per step.")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--step-seconds", type=float, help="One GPU's step time, measured elsewhere.")
    parser.add_argument(
        "--from-json", type=Path, help="A benchmarks/pretrain.py --json report (its fused row)."
    )
    parser.add_argument(
        "--mfu", type=float, default=0.55, help="Without a step time: the step this MFU implies."
    )
    # The H100 ran a bf16 8192³ matmul at 793 TFLOP/s: the MFU denominator it states.
    parser.add_argument("--peak-tflops", type=float, default=793.0)
    parser.add_argument("--json", type=Path, dest="json_path")
    add_record_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        seconds, source = step_from_report(args.from_json, args.preset, args.batch)
    elif args.step_seconds:
        seconds, source = args.step_seconds, "given (--step-seconds)"
    else:
        seconds = goal_step_seconds(args.preset, args.batch, args.seq_len, args.mfu, args.peak_tflops * 1e12)
        source = f"implied by {args.mfu:.0%} MFU of {args.peak_tflops:g} TFLOP/s"
    result = model(
        args.preset,
        step_seconds=seconds,
        step_source=source,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        nvlink_gbps=args.nvlink_gbps,
        infiniband_gbps=args.infiniband_gbps,
        grad_bytes=args.grad_bytes,
    )
    gpus = result.nodes * result.gpus_per_node
    print(
        f"{result.preset}: {result.num_params:,} parameters, {gpus} GPUs ({result.nodes} × {result.gpus_per_node})"
    )
    print(f"step on one GPU: {result.step_seconds * 1e3:.1f} ms ({result.step_source})")
    print("| quantity | value |")
    print("|---|---|")
    for label, value in (
        ("all-reduce bytes per GPU per step", f"{result.allreduce_bytes / 1e6:,.0f} MB"),
        ("NVLink (reduce-scatter + all-gather)", f"{result.nvlink_seconds * 1e3:.2f} ms"),
        ("InfiniBand (all-reduce of 1/8 across nodes)", f"{result.infiniband_seconds * 1e3:.2f} ms"),
        ("all-reduce in all", f"{result.allreduce_seconds * 1e3:.2f} ms"),
        ("share that can overlap the backward (read-out)", f"{result.overlappable_share:.1%}"),
        ("exposed communication", f"{result.exposed_seconds * 1e3:.2f} ms"),
        ("expected efficiency", f"{result.efficiency:.1%}"),
        (f"speed-up on {gpus} GPUs", f"{result.speedup:.0f}×"),
        ("Puri et al. 2018 (128 V100s)", f"{PAPER_EFFICIENCY:.0%}, {PAPER_EFFICIENCY * PAPER_GPUS:.0f}×"),
    ):
        print(f"| {label} | {value} |")
    if args.json_path:
        args.json_path.write_text(json.dumps(asdict(result), indent=2) + "\n")
    record("scaling", args.record, {"model": asdict(result), "peak_tflops": args.peak_tflops}, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
