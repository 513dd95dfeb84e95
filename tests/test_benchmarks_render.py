"""docs/benchmarks.md is what benchmarks/render.py renders from the committed result files, and nothing else."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import load_benchmark


@pytest.fixture
def render(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # benchmarks/ is no package: load the script by path, with its folder on the path for `common`.
    module = load_benchmark("render.py", "render_benchmarks", monkeypatch)
    return module


def test_the_page_is_what_the_result_files_render(render: ModuleType) -> None:
    # A figure typed into the page, or a result file recorded without re-rendering, fails here.
    assert render.DOC.read_text() == render.render(render.TEMPLATE.read_text()), (
        "docs/benchmarks.md is stale or edited by hand: run `PYTHONPATH=. .venv/bin/python benchmarks/render.py`"
    )


def test_every_result_file_is_on_the_page(render: ModuleType) -> None:
    placeholders = {match["name"] for match in render.PLACEHOLDER.finditer(render.TEMPLATE.read_text())}
    recorded = {path.stem for path in render.RESULTS.glob("*.json")}
    assert recorded <= placeholders, f"result files no section shows: {sorted(recorded - placeholders)}"


def test_a_section_shows_its_run_or_the_command_that_records_it(render: ModuleType, tmp_path: Path) -> None:
    template = "## Probe\n\n{{ probe-cpu | python benchmarks/probe.py --record cpu }}\n"
    missing = render.render(template, tmp_path)
    assert "*To be measured*" in missing and "python benchmarks/probe.py --record cpu" in missing

    document = {
        "benchmark": "probe",
        "variant": "cpu",
        "command": "python benchmarks/probe.py --cases sst:64 --record cpu",
        "commit": "0123456789abcdef",
        "date": "2026-11-24 21:00 UTC",
        "machine": {"cpu": "Some CPU", "cores": 2, "ram_gib": 23.5, "python": "3.11.7"},
        "results": {
            "Cs": [0.5, 1.0],
            "rows": [
                {
                    "case": "sst-sized × 64",
                    "liblinear_s": 12.5,
                    "torch_s": 2.5,
                    "speedup": 5.0,
                    "C": [0.5, 0.5],
                    "dev_accuracy": [0.81, 0.81],
                    "test_accuracy": [0.8, 0.79],
                    "max_dev_gap_points": 0.1,
                }
            ],
        },
    }
    (tmp_path / "probe-cpu.json").write_text(json.dumps(document))
    page = render.render(template, tmp_path)
    assert "To be measured" not in page
    assert "| sst-sized × 64 | torch | 12.5 | 2.5 | 5.00× |" in page
    assert "python benchmarks/probe.py --cases sst:64 --record cpu" in page
    assert "`0123456789`" in page and "2026-11-24 21:00 UTC" in page and "2 × Some CPU" in page


def test_a_recorded_run_keeps_its_machine_command_commit_and_date(
    render: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = sys.modules["common"]  # loaded by render.py
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    assert common.record("probe", None, {"rows": [1]}) is None and not list(tmp_path.iterdir())

    argv = ["--cases", "sst:64", "--record", "cpu"]
    path = common.record("probe", "cpu", {"machine": {"cpu": "Some CPU"}, "rows": [1]}, argv=argv)
    document = json.loads(path.read_text())
    assert path == tmp_path / "probe-cpu.json"
    assert document["command"] == "python benchmarks/probe.py --cases sst:64 --record cpu"
    assert document["machine"] == {"cpu": "Some CPU"} and document["results"] == {"rows": [1]}
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", document["commit"])
    assert document["date"].endswith(" UTC")


def test_each_section_and_record_is_on_the_page_once(render: ModuleType) -> None:
    # An edit that pasted a second copy of a stretch of the page (its sections, its records) fails here.
    template = render.TEMPLATE.read_text()
    sections = re.findall(r"^## .*$", template, flags=re.MULTILINE)
    records = [match["name"] for match in render.PLACEHOLDER.finditer(template)]
    assert len(sections) == len(set(sections)), sorted({s for s in sections if sections.count(s) > 1})
    assert len(records) == len(set(records)), sorted({r for r in records if records.count(r) > 1})
