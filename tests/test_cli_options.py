"""Every stage command's settings come from its parameters model: each field is a flag of the command
with the field's help and default (a Literal's values as its choices), and no other flag sets what a
model holds. A setting is then declared once; a second declaration in the CLI fails here."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest
from pydantic import BaseModel
from typer.main import get_command
from typer.testing import CliRunner

from flows.cli import app
from tasks.corpus.config import CorpusConfig
from tasks.finetune.config import FinetuneParams
from tasks.pretrain.config import PretrainParams
from tasks.score.config import ScoreParams
from tasks.settings import WorkerOptions, flag_of
from tasks.sweep.config import SweepRunOptions
from tasks.transfer.config import ProbeFilesParams, ProbeSettings, TransferParams

# Each command, the models its settings come from, and the fields that are no flag of it.
COMMANDS: dict[tuple[str, ...], tuple[tuple[type[BaseModel], ...], set[str]]] = {
    ("pretrain",): ((PretrainParams,), set()),
    ("finetune",): ((FinetuneParams,), set()),
    # Blocks only cut a piece's work: the pipeline's and the Prefect form's setting, not a flag.
    ("corpus", "build"): ((CorpusConfig, WorkerOptions), {"block_mb"}),
    ("transfer",): ((TransferParams,), set()),
    ("probe",): ((ProbeFilesParams,), set()),
    ("score",): ((ScoreParams, WorkerOptions), set()),
    ("sweep", "run"): ((SweepRunOptions,), set()),
}
# The flags that are the command line's own, not a stage's settings.
OWN = {"store", "as_json", "create_bucket", "help"}


def _command(path: tuple[str, ...]) -> Any:
    """The click command at ``path`` (Typer vendors click: its classes are not the ``click`` package's)."""
    command: Any = get_command(app)
    for name in path:
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_setting_of_a_command_is_its_models_field_with_its_help_and_default(
    path: tuple[str, ...],
) -> None:
    models, not_flags = COMMANDS[path]
    options = {p.name: p for p in _command(path).params if p.param_type_name == "option"}
    fields = {
        name: info for model in models for name, info in model.model_fields.items() if name not in not_flags
    }
    assert set(options) - OWN == set(fields), "a flag set by hand, or a field that is no flag"
    _flags_are_the_fields(options, fields)


def test_the_pipelines_stage_flags_are_the_stages_fields() -> None:
    """``pipeline --preset``/``--dataset``… are the stages' own fields, ``--incremental`` the pipeline's;
    its other flags set what only the pipeline has (which stages, from a sweep) or edit any field
    (``--set``)."""
    from flows.cli.pipeline import OWN_FLAGS, STAGE_FLAGS
    from tasks.pipeline import PipelineParams

    options = {p.name: p for p in _command(("pipeline",)).params if p.param_type_name == "option"}
    stages = {stage: PipelineParams.model_fields[stage].annotation for stage in STAGE_FLAGS}
    fields = {
        name: stages[stage].model_fields[name]  # type: ignore[union-attr]
        for stage, names in STAGE_FLAGS.items()
        for name in names
    } | {name: PipelineParams.model_fields[name] for name in OWN_FLAGS}
    assert set(options) - OWN == set(fields) | {"force", "from_sweep", "finetune", "set_"}
    _flags_are_the_fields(options, fields)


def _flags_are_the_fields(options: dict[str, Any], fields: dict[str, Any]) -> None:
    """Each field is its flag: the field's name (or ``Flag``), help, default and choices."""
    for name, info in fields.items():
        option, flag = options[name], flag_of(name, info)
        assert flag.name in option.opts, (name, option.opts)
        assert option.help == info.description, name
        if info.is_required():
            assert option.required, name
            continue
        default = info.get_default(call_default_factory=True)
        assert option.default == (flag.text(default) if flag.text else default), name
        assert _choices(option.type_descriptor.annotation) == _choices(info.annotation), name


def _choices(annotation: Any) -> tuple[Any, ...]:
    """A Literal's values, inside an Optional too; () for any other type."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return next((_choices(a) for a in typing.get_args(annotation) if _choices(a)), ())


@pytest.mark.parametrize("command", ["transfer", "probe"])
def test_the_solver_flag_shows_its_choices_and_the_one_default(command: str) -> None:
    text = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
    line = next(line for line in text.splitlines() if "--solver" in line)
    assert "liblinear" in line and "newton" in line, line
    assert "torch" not in text


def test_the_probe_has_one_default_solver_and_sweep_everywhere() -> None:
    from tasks.transfer.precomputed import probe_files
    from tasks.transfer.probe import DEFAULT_CS, fit_probe

    defaults = ProbeSettings()

    def default_of(function: Any, name: str) -> Any:
        return inspect.signature(function).parameters[name].default

    assert default_of(fit_probe, "solver") == default_of(probe_files, "solver") == defaults.solver == "newton"
    assert default_of(fit_probe, "Cs") == default_of(probe_files, "Cs") == DEFAULT_CS == defaults.Cs
