"""The command line: every command's help works, and each stage's commands sit in its own panel."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flows.cli import app

COMMANDS = {
    "Corpus": ["corpus"],
    "Pretrain": ["pretrain", "plan"],
    "Transfer": [
        "features",
        "import-weights",
        "transfer",
        "finetune",
        "predict",
        "score",
        "probe",
        "baseline",
        "explain",
        "generate",
    ],
    "Pipeline": ["pipeline", "run", "status"],
    "Sweep": ["sweep"],
    "Operate": ["checkpoints", "demo", "deploy", "promote", "settings"],
}
CORPUS = ["build", "show", "rejected", "sample"]
SWEEP = ["run", "status"]


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def test_top_level_help_groups_commands_by_stage() -> None:
    text = _help()
    lines = text.splitlines()
    for panel, commands in COMMANDS.items():
        start = next(i for i, line in enumerate(lines) if line.startswith(f"╭─ {panel} "))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("╰"))
        listed = [line.split()[1] for line in lines[start + 1 : end] if line.split()[1:] and line[2] != " "]
        assert listed == commands, f"panel {panel}: {listed}"


@pytest.mark.parametrize(
    "args",
    [[c] for commands in COMMANDS.values() for c in commands]
    + [["corpus", c] for c in CORPUS]
    + [["sweep", c] for c in SWEEP],
    ids=lambda args: " ".join(args),
)
def test_every_command_has_help(args: list[str]) -> None:
    text = _help(*args)
    assert f"Usage: mlstm-sentiment {' '.join(args)}" in " ".join(text.split())
