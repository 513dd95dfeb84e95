"""A corpus build's settings: pydantic only, so that the CLI and the pipeline's parameters check them
without loading the build's libraries (pyarrow, numpy)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CorpusConfig(BaseModel):
    """Settings of one corpus build. Those that change the output are part of the corpus id."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    split: tuple[int, int, int] = Field(
        default=(1000, 1, 1), description="train:val:test proportions (the paper's 1000:1:1)."
    )
    shard_mb: int = Field(default=256, ge=1, description="Target shard size, MiB of text.")
    bucket_mb: int = Field(
        default=128, ge=1, description="Input MiB per reduce bucket: bounds a worker's memory."
    )
    piece_mb: int = Field(default=64, ge=1, description="Plain files are parsed in pieces this big.")
    block_mb: int = Field(default=8, ge=1, description="Lines parsed at once within a piece.")

    @field_validator("split")
    @classmethod
    def _split_is_usable(cls, split: tuple[int, int, int]) -> tuple[int, int, int]:
        if any(part < 0 for part in split) or split[0] <= 0:
            raise ValueError(f"split {split}: proportions must be >= 0 and train > 0, e.g. 1000:1:1")
        return split

    @property
    def fractions(self) -> tuple[float, float, float]:
        total = sum(self.split)
        return (self.split[0] / total, self.split[1] / total, self.split[2] / total)

    def identity(self) -> dict[str, Any]:
        """The settings the output depends on (pieces and blocks only change how work is cut)."""
        return {"split": list(self.split), "shard_mb": self.shard_mb, "bucket_mb": self.bucket_mb}


def parse_split(text: str) -> tuple[int, int, int]:
    """``"1000:1:1"`` → ``(1000, 1, 1)``, with an error that names the flag."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--split {text!r}: write three whole numbers train:val:test, e.g. 1000:1:1")
    return (int(parts[0]), int(parts[1]), int(parts[2]))
