"""Figures the docs show that the code computes: each is held to what the code gives now, the way
docs/benchmarks.md is rendered from its result files, so a doc cannot drift from the code it describes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import cli_in_process

from models.config import PRESETS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def si(value: float) -> str:
    """Three significant digits and a unit letter: 74.9 k, 5.86 M, 340 M, 1.35 G."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g}"


def test_the_preset_table_is_what_the_configs_give() -> None:
    page = (DOCS / "pretrain.md").read_text()
    rows = re.findall(r"^\| `(\w+)`[^|]* \| ([\d,]+) \| ([^|]+) \| ([^|]+) \|$", page, re.MULTILINE)
    assert [name for name, *_ in rows] == list(PRESETS)
    for name, units, parameters, flops in rows:
        config = PRESETS[name]()
        assert (units, parameters, flops) == (
            f"{config.hidden_size:,}",
            si(config.num_params),
            si(6 * config.num_params),
        ), name


def documented_commands(page: str, command: str) -> list[tuple[list[str], str]]:
    """Each ``.venv/bin/mlstm-sentiment COMMAND …`` line of a page's code blocks, with the ``# `` lines
    after it (what the page says it prints), joined."""
    found = []
    lines = page.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f".venv/bin/mlstm-sentiment {command} "):
            said = []
            for follow in lines[i + 1 :]:
                if not follow.startswith("# "):
                    break
                said.append(follow.removeprefix("# ").strip())
            found.append((line.split()[1:], " ".join(said)))
    return found


PLANS = documented_commands((DOCS / "pretrain.md").read_text(), "plan")


def test_the_page_shows_plans() -> None:
    assert len(PLANS) >= 2


@pytest.mark.parametrize(("args", "said"), PLANS, ids=[" ".join(args) for args, _ in PLANS])
def test_a_documented_plan_prints_what_the_page_says(args: list[str], said: str) -> None:
    done = cli_in_process(args)
    assert done.returncode in (0, 1)  # 1: the plan does not fit
    assert " ".join(done.stdout.split()) == " ".join(said.split())
