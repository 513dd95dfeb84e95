"""The corpus stage's result: what ``corpus build`` hands on to pretraining and prints with ``--json``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from tasks.corpus.manifest import Manifest


class CorpusResult(BaseModel):
    """A published corpus: its id, its manifest's URI and the counts a user checks first."""

    model_config = ConfigDict(frozen=True)

    corpus_id: str
    manifest_uri: str
    rows: int  # kept: one row per distinct cleaned review
    duplicates: int
    rejected: int
    # A build asked to grow a base (``fallback: full``) that built in full instead: the one line why.
    full_build_reason: str | None = None

    @classmethod
    def of(cls, manifest: Manifest, manifest_uri: str, full_build_reason: str | None = None) -> CorpusResult:
        """The result of a corpus from its manifest (built now, or found built)."""
        totals = manifest.totals
        return cls(
            corpus_id=manifest.corpus_id,
            manifest_uri=manifest_uri,
            rows=totals.kept,
            duplicates=totals.duplicates,
            rejected=totals.rejected,
            full_build_reason=full_build_reason,
        )
