"""The cells and tables every benchmark's section on docs/benchmarks.md is drawn with (``render.py``)."""

from __future__ import annotations

from typing import Any

MIB = 2**20


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; columns whose header ends in a figure's unit stay left-aligned for simplicity."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def num(value: float | None, digits: int = 3) -> str:
    """A figure to ``digits`` significant digits with thousands separators; blank when absent."""
    if value is None:
        return ""
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:,.{digits}g}"


def ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}×"


def percent(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def fixed_cost_table(cases: list[dict[str, Any]]) -> str:
    """A fixed-cost benchmark's cases: the fastest run's seconds, every run's beside it."""
    return table(
        ["case", "seconds", "runs"],
        [[c["name"], num(c["seconds"]), ", ".join(f"{r:g}" for r in c["runs"])] for c in cases],
    )
