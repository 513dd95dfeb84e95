"""What every torchrun job's settings share: the launch, the mark of a setting that changes the
weights, and the job's command line generated from a pydantic model (and read back by the job).

Only pydantic is imported: a command refuses a bad setting without loading torch.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.settings import flag_of

Precision = Literal["auto", "bf16", "fp16", "fp32"]
# What the precision of features means, for every command that reads them (transfer, features, predict,
# score): one text for their flags.
FEATURES_PRECISION = (
    "The features' dtype: auto (bf16 or fp16 on a GPU, fp32 on a CPU), bf16 (on CPUs with AVX-512 BF16 or "
    "AMX about 3x fp32's speed at 1,024 units and more, slower at 64), fp16 or fp32."
)
Sharding = Literal["none", "optimizer", "full"]
SHARDINGS: tuple[Sharding, ...] = typing.get_args(Sharding)
LauncherName = Literal["local", "slurm", "kubernetes"]


class _ChangesWeights:
    """The marker of a setting the trained weights depend on (``Annotated[int, WEIGHTS]``)."""

    def __repr__(self) -> str:
        return "WEIGHTS"


WEIGHTS = _ChangesWeights()


class LaunchSettings(BaseModel):
    """Where the job runs, how wide, and how often it is relaunched: none of it changes the weights (two
    ranks train the same model as one with the same global batch: tested)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # fmt: off
    launcher: LauncherName = Field(default="local", description="local (torchrun here), slurm or kubernetes.")
    nodes: int = Field(default=1, ge=1, description="Nodes (slurm, kubernetes).")
    gpus_per_node: int = Field(default=0, ge=0, description="GPUs per node, one process each.")
    nproc: int | None = Field(default=None, ge=1, description="Processes per node without GPUs. [default: 1]")
    gpu_memory: float = Field(default=80.0, gt=0, description="GiB per GPU, checked before launch.")
    retries: int = Field(default=2, ge=0, description="Relaunches after a crash (resuming from latest).")
    # fmt: on


def checked_run_name(name: str) -> str:
    """A run's name is a key in the store: one path segment."""
    if not name or "/" in name or name.strip() != name or name in (".", ".."):
        raise ValueError(f"run name {name!r} must be a non-empty name without '/' or surrounding spaces")
    return name


def job_args(config: BaseModel) -> list[str]:
    """A job's command-line flags for a config: each field that is not its default, with dashes."""
    args = []
    for name, value in config.model_dump(exclude_defaults=True).items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


Config = typing.TypeVar("Config", bound=BaseModel)


def parse_job_args(cls: type[Config], argv: list[str], *, prog: str, description: str) -> Config:
    """A job's config from its command line (``job_args``'s flags); a bool flag reads True or False."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, info in cls.model_fields.items():
        kind, choices = flag_type(info.annotation)
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=_bool_flag if kind is bool else kind,
            choices=choices,
            required=info.is_required(),
            default=argparse.SUPPRESS,
            help=info.description,
        )
    return cls(**vars(parser.parse_args(argv)))


def _bool_flag(text: str) -> bool:
    if text not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return text == "True"


def flag_type(annotation: Any) -> tuple[type, list[str] | None]:
    """A field's type on a command line, and its choices where it is a Literal (``int | None`` → int)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return str, list(args)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return flag_type(args[0])
    return annotation, None


def flag_errors(error: ValidationError, model: type[BaseModel] | None = None) -> str:
    """A validation error in the words of the command line: ``--batch-size: …; --preset: …``, each field
    by its flag in ``model`` (``--dataset`` for ``datasets``); a check of the whole model names its
    settings itself."""
    fields = model.model_fields if model else {}
    messages = []
    for item in error.errors():
        message = item["msg"].replace("Value error, ", "")
        if not item["loc"]:
            messages.append(message)
            continue
        name, *inner = (str(part) for part in item["loc"])
        flag = flag_of(name, fields[name]).name if name in fields else f"--{name.replace('_', '-')}"
        messages.append(f"{'.'.join([str(flag), *inner])}: {message}")
    return "; ".join(messages)
