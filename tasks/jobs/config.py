"""What every torchrun job's settings share: the launch, the optimizer's settings, the mark of a setting
that changes the weights (and a run's identity from it), and the job's command line generated from a
pydantic model (and read back by the job).

Only pydantic is imported: a command refuses a bad setting without loading torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


# What a mark without ``neutral`` holds: no value leaves the setting out of a run's identity.
_ALWAYS = object()


@dataclasses.dataclass(frozen=True)
class Weights:
    """The mark of a setting the trained weights depend on: ``Annotated[int, WEIGHTS]``. Such settings
    are a run's identity: the pipeline's skip key hashes them and a resume refuses a change to one.

    A setting added once runs exist declares ``neutral``, the value with which it changes nothing (the
    behaviour of the runs trained before it existed): ``Annotated[float, Weights(neutral=0.0)]``. At that
    value it stays out of a run's key, so every existing run keeps its key, and a checkpoint saved
    without it reads as having had it, so every existing run still resumes. A mark without ``neutral``
    (``WEIGHTS``) is always part of the identity, and a checkpoint that lacks its setting is refused."""

    neutral: Any = _ALWAYS

    def has_neutral(self) -> bool:
        return self.neutral is not _ALWAYS

    def __repr__(self) -> str:
        return f"Weights(neutral={self.neutral!r})" if self.has_neutral() else "WEIGHTS"


WEIGHTS = Weights()


def weight_marks(cls: type[BaseModel]) -> dict[str, Weights]:
    """The fields of ``cls`` marked as changing the weights, with their marks."""
    marks = {}
    for name, info in cls.model_fields.items():
        found = [item for item in info.metadata if isinstance(item, Weights)]
        if found:
            marks[name] = found[0]
    return marks


def neutral_values(cls: type[BaseModel]) -> dict[str, Any]:
    """What a checkpoint saved before each of ``cls``'s later settings existed ran with: its neutral value."""
    return {name: mark.neutral for name, mark in weight_marks(cls).items() if mark.has_neutral()}


def run_identity(settings: BaseModel) -> dict[str, Any]:
    """The values of the settings marked as changing the weights, for a run's key: each later one left out
    while it has its neutral value, so that the keys of runs trained before it existed hold."""
    marks = weight_marks(type(settings))
    values = settings.model_dump(include=set(marks))
    return {
        name: value
        for name, value in values.items()
        if not (marks[name].has_neutral() and value == marks[name].neutral)
    }


# The largest float32: a job computes in float32 (the learning rate in Adam's state, the clip in the
# gradients' norm), so a larger setting would be refused by torch only once a trial or a run is under way.
FLOAT32_MAX = 3.4028234663852886e38


class JobSettings(BaseModel):
    """What every job's settings share: each real number fits float32, refused by name when it does not."""

    @field_validator("*")
    @classmethod
    def _fits_float32(cls, value: Any) -> Any:
        if isinstance(value, float) and abs(value) > FLOAT32_MAX:
            raise ValueError(f"more than float32 holds ({FLOAT32_MAX:.4g}), the precision a job computes in")
        return value


class OptimizerSettings(JobSettings):
    """Adam's settings besides its learning rate, shared by every job that trains (pretraining's and
    fine-tuning's settings derive from it); each field is one of Adam's keywords, by name, and
    ``tasks/jobs/optim.py`` passes it on every path (eager, captured, sharded). The learning rate is each
    job's own: its setting differs (scaled by the batch, or per param group) and its schedule moves it.

    None is a setting yet: Adam runs with torch's defaults (betas 0.9 and 0.999, eps 1e-8, no weight
    decay, no AMSGrad). A new one (weight decay, say) is one line here, marked
    ``Weights(neutral=...)`` with the default that reproduces those runs, and a case in its test."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


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
