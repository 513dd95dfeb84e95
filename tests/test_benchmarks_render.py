"""docs/benchmarks.md is what benchmarks/render.py renders from the committed result files, and nothing else."""

from __future__ import annotations

import json
import re
import subprocess
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


def test_a_record_older_than_the_code_it_measures_is_marked_stale(render: ModuleType, tmp_path: Path) -> None:
    # A record kept on the page after its benchmark's code changed reads as a measurement of today's code.
    repo = tmp_path / "repo"
    solvers = repo / "tasks" / "transfer" / "solvers"
    solvers.mkdir(parents=True)

    def commit(path: Path, text: str) -> str:
        path.write_text(text)
        git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "add", "-A"], check=True, capture_output=True)
        subprocess.run([*git, "commit", "-qm", path.name], check=True, capture_output=True)
        return subprocess.run(
            [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip()

    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    first = commit(solvers / "newton.py", "a = 1\n")
    recorded = commit(repo / "README.md", "text\n")  # the record's commit: after the solver's last change
    assert render.stale_line("probe", recorded, repo) is None
    assert render.stale_line("probe", f"{recorded}-dirty", repo) is None
    assert render.stale_line("probe", first, repo) is None  # recorded at that change itself
    commit(repo / "README.md", "more text\n")  # other code changing leaves the record fresh
    assert render.stale_line("probe", recorded, repo) is None
    (solvers / "newton.py").write_text("a = 2\n")  # changed, not yet committed: the page says so already
    line = render.stale_line("probe", recorded, repo)
    assert (
        line
        == f"**Stale**: `tasks/transfer/solvers/` changed since `{recorded[:10]}`; these figures measured the code before."
    )
    changed = commit(solvers / "newton.py", "a = 2\n")
    assert render.stale_line("probe", recorded, repo) == line  # the same line once committed
    assert render.stale_line("probe", changed, repo) is None
    assert "not in this repository" in render.stale_line("probe", "f" * 40, repo)
    assert render.stale_line("no-such-benchmark", recorded, repo) is None

    # A record that keeps the content it measured needs no commit: one taken on a branch and
    # cherry-picked, or read in a clone without its commit, is fresh while that content is today's.
    measured = render.measured_objects("probe", "HEAD", repo)
    assert (
        measured
        == render.measured_objects("probe", changed, repo)
        != render.measured_objects("probe", first, repo)
    )
    assert render.stale_line("probe", "f" * 40, repo, measured) is None
    assert render.stale_line("probe", "f" * 40, repo, render.measured_objects("probe", first, repo)) == (
        line.replace(recorded[:10], "f" * 10)
    )
    (solvers / "newton.py").write_text("a = 3\n")  # uncommitted edits make it stale too
    assert render.stale_line("probe", "f" * 40, repo, measured) is not None
    (solvers / "newton.py").write_text("a = 2\n")

    document = {
        "benchmark": "baseline",
        "command": "python benchmarks/baseline.py --record",
        "commit": first,
        "date": "2026-11-24 21:00 UTC",
        "machine": {"cpu": "Some CPU", "cores": 2, "ram_gib": 23.5, "python": "3.11.7"},
        "results": {"rows": []},
    }
    (tmp_path / "baseline.json").write_text(json.dumps(document))
    (repo / "tasks" / "transfer" / "baseline.py").write_text("b = 1\n")
    commit(repo / "tasks" / "transfer" / "baseline.py", "b = 2\n")
    page = render.render("{{ baseline | python benchmarks/baseline.py --record }}\n", tmp_path, repo)
    assert "**Stale**: `tasks/transfer/baseline.py` changed since" in page


def test_a_figure_in_the_prose_is_read_from_its_record(render: ModuleType, tmp_path: Path) -> None:
    # A ratio typed into a sentence can divide figures of two runs; one read from a record cannot.
    document = {"results": {"rows": [{"liblinear_s": 2022.84, "solver_s": 4.87, "speedup": 415.71}]}}
    (tmp_path / "probe-x.json").write_text(json.dumps(document))
    text = "newton {= probe-x rows.0.speedup | .0f =}×, {= probe-x rows.0.solver_s | .1f =} s against {= probe-x rows.0.liblinear_s | ,.0f =}"
    assert render.render(text, tmp_path).endswith("newton 416×, 4.9 s against 2,023")
    with pytest.raises(SystemExit, match=re.escape("probe-x.json has no 'rows.1.speedup'")):
        render.render("{= probe-x rows.1.speedup =}", tmp_path)
    assert "to be measured" in render.render("{= probe-y rows.0.speedup =}", tmp_path)


def test_a_figure_quoted_in_another_page_is_rewritten_from_its_record(
    render: ModuleType, tmp_path: Path
) -> None:
    # docs/operations.md quotes the weekly run's figures in place: the renderer rewrites them from the record.
    (tmp_path / "weekly-x.json").write_text(json.dumps({"results": {"stages": [{"ratio": 0.314}]}}))
    page = "costs <!-- {= weekly-x stages.0.ratio | .2f =} -->9.99<!-- /= -->× a full run"
    assert render.quoted(page, tmp_path) == page.replace("9.99", "0.31")


def test_the_pages_quoting_figures_are_what_their_records_render(render: ModuleType) -> None:
    # A figure typed into docs/operations.md by hand, or a record made without re-rendering, fails here.
    for path in render.PAGES:
        assert render.QUOTED.search(path.read_text()), f"{path.name} quotes no figure: drop it from PAGES"
        assert path.read_text() == render.quoted(path.read_text()), (
            f"{path.name} is stale: run `PYTHONPATH=. .venv/bin/python benchmarks/render.py`"
        )
