"""What every benchmark shares: the working tree on the path, the machine's description, progress lines
and the argument parser's frame.

A benchmark imports this first (``from common import …`` works since Python puts the script's folder on
the path), so that it measures the checkout it sits in, not whatever copy the venv has installed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def say(message: str) -> None:
    """A progress line on stderr (stdout is kept for --json)."""
    print(message, file=sys.stderr, flush=True)


def new_parser(description: str, *, raw: bool = False) -> argparse.ArgumentParser:
    """The argument parser of a benchmark; ``raw`` keeps the description's lines (a module docstring)."""
    formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
    return argparse.ArgumentParser(description=description, formatter_class=formatter)


def machine(device: Any = None, **versions: str) -> dict[str, Any]:
    """What the numbers ran on: the CPU, cores this process may use, memory, Python, the platform, torch
    and the GPU when ``device`` is a CUDA one; ``versions`` adds the libraries a benchmark measures."""
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as stream:
        model = next((ln.partition(":")[2].strip() for ln in stream if ln.startswith("model name")), model)
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as stream:
        mem_kib = int(stream.readline().split()[1])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    info: dict[str, Any] = {
        "cpu": model,
        "cores": cores,
        "ram_gib": round(mem_kib / 2**20, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **versions,
    }
    if device is not None:
        import torch

        info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "device": str(device)}
        if device.type == "cuda":
            properties = torch.cuda.get_device_properties(device)
            info |= {
                "gpu": torch.cuda.get_device_name(device),
                "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
                "cuda": torch.version.cuda,
                "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            }
    return info


def describe(info: dict[str, Any]) -> str:
    """The machine in one line, for a table's title."""
    where = info.get("gpu") or f"{info['cores']} × {info['cpu']}"
    return f"{where}, {info['ram_gib']} GiB, Python {info['python']}"
