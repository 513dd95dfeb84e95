"""`predict` refuses texts with nothing to score before it loads a model (issue 19, "Bad input").

Guards: an empty or whitespace-only text, given as an argument or as a row of ``--input``, is one
error line naming where it is, exit code 2, no traceback, and no model is loaded (none exists here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app


def _predict(args: list[str], home: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setenv("MLSTM_HOME", str(home))
    result = CliRunner().invoke(app, ["predict", *args], terminal_width=200)
    return result.exit_code, result.output


@pytest.mark.parametrize("blank", ["", "   ", "\t\n"])
def test_an_empty_argument_is_named_and_nothing_is_scored(
    blank: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, output = _predict(["a fine product", blank], tmp_path, monkeypatch)
    assert code == 2, output
    assert "text 2 of the arguments is empty" in output
    assert "Traceback" not in output and "cannot load" not in output


def test_an_empty_row_of_the_input_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "texts.csv"
    table.write_text("text\ngreat value\n  \nbroke in a day\n", encoding="utf-8")
    code, output = _predict(["--input", str(table)], tmp_path, monkeypatch)
    assert code == 2, output
    assert f"{table}: line 3: 'text' is empty" in " ".join(output.split())
    assert "Traceback" not in output and "cannot load" not in output
