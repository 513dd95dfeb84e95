"""The mLSTM's size and its presets: plain numbers, no torch, so that a command can check a setting
(``--preset``, ``--recurrence``) and plan memory without loading a tensor library.

Presets are plain functions returning a config; ``models/mlstm.py`` builds the model from one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# "fused": models/recurrence.py (the default); "reference": MLSTM.cell step by step under autograd.
Recurrence = Literal["fused", "reference"]
RECURRENCES: tuple[Recurrence, ...] = ("fused", "reference")


@dataclass(frozen=True, kw_only=True)
class MLSTMConfig:
    hidden_size: int
    embed_size: int = 64
    vocab_size: int = 256

    def __post_init__(self) -> None:
        for name in ("hidden_size", "embed_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLSTMConfig.{name} must be positive, got {getattr(self, name)}")

    @property
    def num_params(self) -> int:
        E, H, V = self.embed_size, self.hidden_size, self.vocab_size
        cell = E * 4 * H + H * 4 * H + E * H + H * H  # W_x, W_h, W_mx, W_mh
        gains = 4 * H + 4 * H + H + H
        return V * E + cell + gains + 4 * H + H * V + V


def tiny() -> MLSTMConfig:
    """For CI and tests: trains in seconds on a CPU."""
    return MLSTMConfig(hidden_size=64)


def small() -> MLSTMConfig:
    """A laptop-scale model: 1024 units, about 5.9M parameters."""
    return MLSTMConfig(hidden_size=1024)


def paper_4096() -> MLSTMConfig:
    """Radford et al. 2017 and Puri et al. 2018: 4096 units, about 86M parameters."""
    return MLSTMConfig(hidden_size=4096)


def paper_8192() -> MLSTMConfig:
    """Puri et al. 2018's larger model: 8192 units, about 340M parameters."""
    return MLSTMConfig(hidden_size=8192)


# Past one GPU (the job's --sharding; `mlstm-sentiment plan` says how many GPUs). The cell's four
# matrices are 5·H² + 5·E·H parameters; fp32 weights + gradients + Adam's two moments are 16 bytes each.
def large_16384() -> MLSTMConfig:
    """16384 units: 5·16384² ≈ 1.34B parameters, ≈ 21.5 GB of weights + gradients + Adam state."""
    return MLSTMConfig(hidden_size=16384)


def large_32768() -> MLSTMConfig:
    """32768 units: 5·32768² ≈ 5.37B parameters, ≈ 86 GB of weights + gradients + Adam state, more than
    one 80 GiB GPU holds before any activation: ``--sharding full`` over at least two."""
    return MLSTMConfig(hidden_size=32768)


PRESETS = {
    "tiny": tiny,
    "small": small,
    "paper_4096": paper_4096,
    "paper_8192": paper_8192,
    "large_16384": large_16384,
    "large_32768": large_32768,
}


def preset(name: str) -> MLSTMConfig:
    """The config of a preset, with an error that lists the names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
