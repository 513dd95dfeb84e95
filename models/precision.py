"""Mixed precision: which dtype a device computes in, and the autocast context for it.

The one place the bf16/fp16 choice is made: the training job (``--precision auto``) and the features
(``models.features.featurize``) ask here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# The precisions' short names: the job's --precision values, and the keys of its measured peaks file.
PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
