"""A corpus build's settings: pydantic only, so that the CLI and the pipeline's parameters check them
without loading the build's libraries (pyarrow, numpy). Each field a flag of ``corpus build`` shows is
generated from it (``flows/cli/corpus.py``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.settings import Flag


def _split_text(split: tuple[int, int, int]) -> str:
    return ":".join(str(part) for part in split)


class CorpusConfig(BaseModel):
    """Settings of one corpus build. Those that change the output are part of the corpus id."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The flag takes it as text: --split 1000:1:1.
    split: Annotated[tuple[int, int, int], Flag(text=_split_text)] = Field(
        default=(1000, 1, 1), description="train:val:test proportions (the paper's 1000:1:1)."
    )
    shard_mb: int = Field(default=256, ge=1, description="Target shard size in MiB of text.")
    bucket_mb: int = Field(
        default=128, ge=1, description="Input MiB per dedupe bucket: bounds a worker's memory."
    )
    piece_mb: int = Field(default=64, ge=1, description="Plain files are parsed in pieces of this many MiB.")
    block_mb: int = Field(default=8, ge=1, description="Lines parsed at once within a piece.")
    # Not in the corpus's identity: a delta's id names its base's corpus id instead.
    base: str | None = Field(
        default=None,
        description=(
            "Grow this corpus (its manifest URI, or newest: the one published last in the store) by the "
            "SOURCES it does not hold; refused if one of its sources is missing or changed (see --fallback)."
        ),
    )
    # Not in the identity either: it picks which plan is built, and each plan's id says what it holds.
    fallback: Literal["refuse", "full"] = Field(
        default="refuse",
        description=(
            "When the base cannot be grown (no corpus in the store, a base source missing or changed, "
            "another split, no key index): refuse, or build all the SOURCES in full, saying why in one line."
        ),
    )

    @field_validator("split", mode="before")
    @classmethod
    def _split_of_text(cls, split: Any) -> Any:
        """``"1000:1:1"`` → ``(1000, 1, 1)``; a list or tuple passes as it is."""
        if not isinstance(split, str):
            return split
        parts = split.split(":")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{split!r}: write three whole numbers train:val:test, e.g. 1000:1:1")
        return tuple(int(p) for p in parts)

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
