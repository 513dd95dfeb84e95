"""How a run of a sweep proceeds, beside its spec (``spec.py``): pydantic only, so that ``sweep run --help``
loads no YAML parser."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SweepRunOptions(BaseModel):
    """The ``sweep run`` command's settings: not part of the sweep's identity (its spec is)."""

    model_config = ConfigDict(extra="forbid")

    parallel: int = Field(default=1, ge=1, description="Trials at once (each holds a GPU slot).")
