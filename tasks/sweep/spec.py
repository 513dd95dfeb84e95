"""A sweep's spec (YAML): what to search, on which corpus, with what budget; checked before any trial.

Every mistake a spec can hold is found here, as one error naming the key (and its line in the file):
an unknown key or parameter, an empty range, a budget below one rung, a batch the ranks cannot split.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from tasks.pretrain.config import PretrainParams

# The parameters the sweep sets itself on every launch: a spec cannot fix or search them.
SWEEP_OWNED = ("corpus", "run", "max_steps", "total_steps")
# Pretraining parameters a spec may search (numbers and choices that change the weights).
SEARCHABLE = ("lr", "batch_size", "seq_len", "warmup_steps", "lr_scaling", "precision")
SPEC_KEYS = ("corpus", "objective", "budget", "asha", "sampler", "seed", "space")


class SpecError(ValueError):
    """A spec that cannot run; the message names the file, the key and its line."""


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Bounds far above any sweep that finishes: a typo of a few zeros is refused, not queued for ever.
    trials: int = Field(ge=1, le=10_000, description="Trials in the sweep (sampled configurations).")
    max_steps: int = Field(
        ge=1, le=10**9, description="Steps of a trial that reaches the last rung; its schedule."
    )


class Asha(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_steps: int = Field(ge=1, description="Steps of the first rung.")
    eta: int = Field(default=3, ge=2, description="Reduction factor: the top 1/eta of a rung goes on.")


def _check_range(kind: str, low: float, high: float, *, strict: bool = True, positive: bool = False) -> None:
    """The range rule of every distribution: low below high (or equal, for integers), and above 0 where
    the scale is logarithmic."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{kind} needs finite ends, got [{low}, {high}]")
    if not ((low < high if strict else low <= high) and (low > 0 or not positive)):
        needs = f"{'0 < ' if positive else ''}low {'<' if strict else '<='} high"
        raise ValueError(f"{kind} needs {needs}, got [{low}, {high}]")


class LogUniform(BaseModel):
    model_config = ConfigDict(extra="forbid")
    log_uniform: tuple[float, float]

    @model_validator(mode="after")
    def _range(self) -> LogUniform:
        _check_range("log_uniform", *self.log_uniform, positive=True)
        return self


class Uniform(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uniform: tuple[float, float]

    @model_validator(mode="after")
    def _range(self) -> Uniform:
        _check_range("uniform", *self.uniform)
        return self


class IntUniform(BaseModel):
    model_config = ConfigDict(extra="forbid")
    int_uniform: tuple[int, int]

    @model_validator(mode="after")
    def _range(self) -> IntUniform:
        _check_range("int_uniform", *self.int_uniform, strict=False)
        return self


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    choice: list[float | int | str] = Field(min_length=1)


def _kind(value: Any) -> str | None:
    """Which distribution a space entry is: its one key (``{log_uniform: [a, b]}``)."""
    if isinstance(value, dict) and len(value) == 1:
        return str(next(iter(value)))
    if isinstance(value, BaseModel):
        return str(next(iter(type(value).model_fields)))
    return None


DISTRIBUTIONS = ("log_uniform", "uniform", "int_uniform", "choice")
Distribution = Annotated[
    Annotated[LogUniform, Tag("log_uniform")]
    | Annotated[Uniform, Tag("uniform")]
    | Annotated[IntUniform, Tag("int_uniform")]
    | Annotated[Choice, Tag("choice")],
    Discriminator(
        _kind,
        custom_error_type="distribution",
        custom_error_message="a distribution is one of {log_uniform: [low, high]}, {uniform: [low, high]}, "
        "{int_uniform: [low, high]}, {choice: [a, b, …]}",
    ),
]


class SweepSpec(BaseModel):
    """The spec: the search (``space``, ``sampler``, ``seed``), its budget and rungs, fixed settings."""

    model_config = ConfigDict(extra="forbid")

    corpus: str = Field(description="URI of the corpus manifest.json, or newest.")
    objective: Literal["val_bpc"] = Field(default="val_bpc", description="Minimised at every rung.")
    budget: Budget
    asha: Asha
    sampler: Literal["random", "tpe", "grid"] = "random"
    seed: int = Field(default=0, description="The sampler's seed.")
    space: dict[str, Distribution] = Field(min_length=1)
    fixed: dict[str, Any] = Field(
        default_factory=dict, description="Pretraining parameters every trial shares (preset, …)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> SweepSpec:
        if self.budget.max_steps < self.asha.min_steps:
            raise KeyedError(
                "budget.max_steps",
                f"{self.budget.max_steps} is below one rung (asha.min_steps {self.asha.min_steps})",
            )
        for name in self.space:
            if name not in SEARCHABLE:
                raise KeyedError(
                    f"space.{name}", f"not a searchable parameter: choose {', '.join(SEARCHABLE)}"
                )
            if name in self.fixed:
                raise KeyedError(f"space.{name}", "is also fixed at the top of the spec: keep one")
        if self.sampler == "grid":
            for name, dist in self.space.items():
                if not isinstance(dist, Choice):
                    raise KeyedError(
                        f"space.{name}", "the grid sampler needs a choice list for every parameter"
                    )
            points = math.prod(len(dist.choice) for dist in self.space.values() if isinstance(dist, Choice))
            if self.budget.trials > points:
                # Optuna's GridSampler would draw the surplus trials again from visited points.
                raise KeyedError(
                    "budget.trials",
                    f"{self.budget.trials} trials but the grid has {points} points: ask for at most {points}",
                )
        for name in self.fixed:
            if name in SWEEP_OWNED or name not in PretrainParams.model_fields:
                raise KeyedError(
                    name, "unknown key: not a spec key nor a pretrain parameter the sweep leaves free"
                )
        for name, dist in self.space.items():
            self._check_values(name, dist)
        world = self.world_size()
        where = "space.batch_size" if "batch_size" in self.space else "batch_size"
        batch_range = self.space.get("batch_size")
        if world > 1 and isinstance(batch_range, IntUniform) and len(set(batch_range.int_uniform)) > 1:
            raise KeyedError(
                where,
                f"a range of batches holds some that do not split among {world} ranks: give a choice list",
            )
        for batch in self.batch_values():
            if batch % world:
                raise KeyedError(where, f"a batch of {batch} rows does not split among {world} ranks")
        return self

    def _check_values(self, name: str, dist: LogUniform | Uniform | IntUniform | Choice) -> None:
        """Every value the space can give ``name`` (a choice's, a range's ends) is one the pretraining
        settings take: a bad one is named by its spec key, not by the model that refuses it."""
        values = dist.choice if isinstance(dist, Choice) else next(iter(dist.model_dump().values()))
        for value in values:
            try:
                PretrainParams(corpus=self.corpus, **{**self.fixed, name: value})
            except ValidationError as invalid:
                message = invalid.errors()[0]["msg"].removeprefix("Value error, ")
                raise KeyedError(f"space.{name}", f"{value!r}: {message}") from None

    def world_size(self) -> int:
        params = PretrainParams(corpus=self.corpus, **self.fixed)
        return params.nodes * params.nproc_per_node

    def batch_values(self) -> list[int]:
        """Every batch size a trial can have (the range's ends for an integer range)."""
        dist = self.space.get("batch_size")
        if dist is None:
            return [int(self.fixed.get("batch_size", PretrainParams.model_fields["batch_size"].default))]
        if isinstance(dist, Choice):
            return [int(v) for v in dist.choice]
        if isinstance(dist, IntUniform):
            return sorted(set(dist.int_uniform))  # its ends: a wider range was refused with several ranks
        raise KeyedError("space.batch_size", "a batch size is an int_uniform range or a choice list")

    def rungs(self) -> list[int]:
        """The steps at which trials are compared: min_steps · etaⁱ below max_steps, then max_steps."""
        steps, rung = [], self.asha.min_steps
        while rung < self.budget.max_steps:
            steps.append(rung)
            rung *= self.asha.eta
        return [*steps, self.budget.max_steps]

    def sweep_id(self) -> str:
        """A content hash of the spec: the same spec is the same sweep, so a rerun continues it."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return "sweep-" + hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def trial_params(self, values: dict[str, Any], run: str, max_steps: int) -> PretrainParams:
        """The pretraining launch of a trial up to ``max_steps``, on the sweep's whole schedule."""
        return PretrainParams(
            **{**self.fixed, **values},
            corpus=self.corpus,
            run=run,
            max_steps=max_steps,
            total_steps=self.budget.max_steps,
        )


class KeyedError(ValueError):
    """Raised inside validation with the dotted key at fault; ``load_spec`` adds the file and line."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def parse_spec(data: dict[str, Any], source: str = "spec", lines: dict[str, int] | None = None) -> SweepSpec:
    """A spec from parsed YAML; ``lines`` maps dotted keys to their line in ``source``."""
    lines = lines or {}

    def error(key: str, message: str) -> SpecError:
        line = _line_of(key, lines)
        return SpecError(f"{source}{f':{line}' if line else ''}: {key}: {message}")

    if not isinstance(data, dict):
        raise SpecError(f"{source}: a sweep spec is a mapping of keys (corpus, budget, asha, space, …)")
    top = {k: v for k, v in data.items() if k in SPEC_KEYS}
    fixed = {k: v for k, v in data.items() if k not in SPEC_KEYS}
    for key in fixed:
        if key in SWEEP_OWNED or key not in PretrainParams.model_fields:
            raise error(
                str(key),
                "unknown key: a spec has corpus, objective, budget, asha, sampler, seed, "
                "space and pretrain parameters (preset, seq_len, nproc, launcher, …)",
            )
    try:
        PretrainParams(corpus=str(data.get("corpus", "newest")), **fixed)
        return SweepSpec(**top, fixed=fixed)
    except KeyedError as keyed:
        raise error(keyed.key, keyed.message) from None
    except ValidationError as invalid:
        item = invalid.errors()[0]
        location: list[str] = []
        for part in map(str, item["loc"]):
            if part != "fixed" and (not location or location[-1] != part):  # a tag, then its field
                location.append(part)
        key = ".".join(location) or "spec"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif item["type"] == "missing":
            message = "missing"
        original = item.get("ctx", {}).get("error")
        if isinstance(original, KeyedError):
            key, message = original.key, original.message
        raise error(key, message) from None


def load_spec(path: str | Path) -> SweepSpec:
    """Read and check a spec file; every problem is a ``SpecError`` naming the key and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as failure:
        raise SpecError(f"{path}: cannot read the sweep spec ({failure.strerror})") from None
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text)):
            # Anchors and aliases can nest a few lines into billions of values (a "billion laughs").
            raise SpecError(
                f"{path}: YAML aliases (*name) are not taken in a sweep spec: write the values out"
            )
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as failure:
        mark = getattr(failure, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise SpecError(f"{path}{where}: not YAML ({getattr(failure, 'problem', failure)})") from None
    return parse_spec(data, str(path), _key_lines(node))


def _key_lines(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Dotted key → 1-based line, for every key of a YAML mapping tree."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = f"{prefix}{key.value}"
            lines[name] = key.start_mark.line + 1
            lines.update(_key_lines(value, f"{name}."))
    return lines


def _line_of(key: str, lines: dict[str, int]) -> int | None:
    """The line of ``key``, or of its nearest parent that the file has."""
    parts = key.split(".")
    while parts:
        if ".".join(parts) in lines:
            return lines[".".join(parts)]
        parts.pop()
    return None
