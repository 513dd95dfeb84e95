"""The ``score`` command's parameters: pydantic only, so that its help and refusals load neither pyarrow nor
torch. The workers' settings are shared with ``corpus build`` (``tasks.settings.WorkerOptions``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from tasks.jobs.config import FEATURES_PRECISION, Precision
from tasks.settings import Flag

PIECE_ROWS = 1024  # rows per piece: the unit of parallel work and of resuming


class ScoreParams(BaseModel):
    """Where scores go, with which model, from which columns, in what pieces."""

    model_config = ConfigDict(extra="forbid")

    output: str = Field(description="Folder or s3://bucket/prefix; scores go to OUTPUT/<scoring id>/.")
    model: str | None = Field(
        default=None,
        description="models:/NAME@ALIAS or models:/NAME/VERSION. [default: models:/<MLSTM_MODEL_NAME>@champion]",
    )
    text_column: str = Field(default="text", description="The column (JSON field) holding the review.")
    id_columns: Annotated[list[str] | None, Flag("--id-column")] = Field(
        default=None, description="A column to copy beside the scores; repeatable."
    )
    piece_rows: int = Field(
        default=PIECE_ROWS, ge=1, description="Rows per piece on average (parallel work, resuming)."
    )
    precision: Precision = Field(default="auto", description=FEATURES_PRECISION)
