"""Mixed precision: which dtype a device computes in, and the autocast context for it.

The one place the bf16/fp16 choice is made: the training job (``--precision auto``) and the features
(``models.features.featurize``, ``--precision`` of ``features``, ``transfer`` and ``score``) ask here.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

# The precisions' short names: the job's --precision values, and the keys of its measured peaks file.
PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
PRECISION_CHOICES = ("auto", *PRECISION_NAMES.values())  # what resolve_precision takes


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The dtype for a precision name (``auto``, ``bf16``, ``fp16``, ``fp32``) on ``device``.

    ``auto`` is bf16 on GPUs that have it, fp16 on older ones (a GradScaler then keeps the gradients
    from underflowing), and fp32 on the CPU.
    """
    if precision == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {name: dtype for dtype, name in PRECISION_NAMES.items()}[precision]


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``dtype`` on ``device``; in fp32, no autocast at all."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX): where it does, features of
    1,024 units and more read about 3× faster than in fp32 (docs/benchmarks.md; at 64 units, slower:
    the casts cost more than the small products save); elsewhere torch emulates bf16, slower than fp32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def feature_precision(precision: str, device: torch.device) -> torch.dtype:
    """The dtype features are read in: ``resolve_precision``'s, so ``auto`` stays fp32 on a CPU (exact,
    the same features on every CPU), and ``bf16`` there is the user's choice: a warning where the CPU
    would emulate it."""
    dtype = resolve_precision(precision, device)
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        warnings.warn(
            "bf16 features on a CPU without AVX-512 BF16 or AMX are emulated, slower than fp32: "
            "use --precision fp32 (or auto) here",
            RuntimeWarning,
            stacklevel=2,
        )
    return dtype
