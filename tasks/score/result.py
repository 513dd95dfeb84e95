"""The scoring stage's result: where a run's output and manifest are, what scored it, and its counts;
what ``score --json`` prints."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ScoreResult(BaseModel):
    """A scoring run: its output folder and manifest, the registered version, rows in and out."""

    model_config = ConfigDict(frozen=True)

    output: str
    manifest_uri: str
    model_uri: str
    model_version: int
    rows_in: int
    rows_out: int
    rejected: int
    labels: dict[str, int]  # rows per predicted label
    pieces_scored: int  # by this run
    pieces_skipped: int  # done by an earlier run of the same scoring id

    @classmethod
    def of(cls, manifest: dict[str, Any], manifest_uri: str, *, scored: int, skipped: int) -> ScoreResult:
        """A run's result from its manifest and the pieces this run scored or found done."""
        return cls(
            output=manifest["output"],
            manifest_uri=manifest_uri,
            model_uri=manifest["model"]["uri"],
            model_version=manifest["model"]["version"],
            rows_in=manifest["rows_in"],
            rows_out=manifest["rows_out"],
            rejected=manifest["rejected"]["rows"],
            labels=manifest["labels"],
            pieces_scored=scored,
            pieces_skipped=skipped,
        )
