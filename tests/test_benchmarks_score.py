"""benchmarks/score.py's repeats: a row's seconds are the median of its runs, each run kept in order, and
the page shows them with each repeat's ratios. No scoring here: the rows are given."""

from __future__ import annotations

import json

import pytest
from conftest import BENCHMARKS, load_benchmark


def test_a_repeated_row_is_the_median_of_its_runs_with_each_run_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("score.py", "score_benchmark", monkeypatch)
    rows = module.Rows(100, 10_000)
    assert rows.add("score (process pool)", 50.0, peak_rss=3, flow_seconds=40.0) == 1
    assert rows.add("predict --input", 80.0) == 1
    rows.add("score (process pool)", 70.0, peak_rss=5, flow_seconds=60.0)
    assert rows.add("score (process pool)", 55.0, peak_rss=4, flow_seconds=45.0) == 3
    pool, predict = rows.results
    assert pool == {
        "name": "score (process pool)",
        "seconds": 55.0,
        "rows_per_s": 100 / 55.0,
        "chars_per_s": 10_000 / 55.0,
        "peak_rss": 5,  # the largest of the runs
        "flow_seconds": 45.0,
        "each_seconds": [50.0, 70.0, 55.0],  # in the order they ran
    }
    assert predict["seconds"] == 80.0 and "each_seconds" not in predict
    assert rows.timed["score (process pool)"] == [50.0, 70.0, 55.0]


def test_fewer_than_one_repeat_or_a_negative_grow_is_refused_by_its_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load_benchmark("score.py", "score_benchmark", monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        module.main(["--repeats", "0"])
    assert stopped.value.code == 2 and "--repeats 0: must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        module.main(["--grow", "-1"])
    assert (
        stopped.value.code == 2
        and "--grow -1: must be 0 (no larger input) or more" in capsys.readouterr().err
    )


def test_the_page_shows_each_run_and_each_repeat_s_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    render = load_benchmark("render.py", "render_score", monkeypatch)
    recorded = json.loads((BENCHMARKS / "results" / "score.json").read_text())["results"]
    # The record as one run of each: no repeats said, no runs or ratios in brackets.
    recorded["settings"]["repeats"] = 1
    for run in recorded["runs"]:
        run.pop("each_seconds", None)
    for key in ("score_vs_features_each", "dask_vs_process_pool_each"):
        recorded["checks"].pop(key, None)
    once = render.score_tables(recorded)
    assert "times each" not in once and "Each repeat" not in once
    assert "features in" not in once  # auto: as recorded before --precision
    recorded["settings"]["precision"] = "bf16"
    assert ", tiny model (features and `predict --input` in bf16), 2 workers" in render.score_tables(recorded)
    del recorded["settings"]["precision"]
    pool = next(r for r in recorded["runs"] if r["name"] == "score (process pool)")
    pool |= {"seconds": 61.7, "each_seconds": [61.7, 70.0, 58.0]}
    recorded["settings"]["repeats"] = 3
    recorded["checks"]["score_vs_features_each"] = [1.18, 0.95, 1.2]
    recorded["checks"]["dask_vs_process_pool_each"] = [0.86, 1.04, 0.91]
    page = render.score_tables(recorded)
    assert "ran 3 times each, interleaved" in page
    assert "| 61.7 (61.7, 70, 58) |" in page
    assert page.endswith(
        "Each repeat's own ratios: score ÷ features 1.18, 0.95, 1.20; Dask ÷ pool 0.86, 1.04, 0.91."
    )


def test_a_run_without_a_larger_input_says_so_and_no_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    render = load_benchmark("render.py", "render_score", monkeypatch)
    recorded = json.loads((BENCHMARKS / "results" / "score.json").read_text())["results"]
    recorded["settings"]["grow"] = 0
    recorded["memory"] = {k: v for k, v in recorded["memory"].items() if k.startswith("1x")}
    for key in ("memory_growth", "grown_rows_per_s"):
        del recorded["checks"][key]
    page = render.score_tables(recorded)
    assert (
        f"Peak RSS (process and workers) 1× {recorded['memory']['1x'] / 2**30:.2f} GiB (no larger input"
        in page
    )
    assert "goal within 1.10×" not in page and ", 0× " not in page
    own, other = (recorded["memory"][key] / 2**30 for key in ("1x_own", "1x_largest_other"))
    assert (
        f"Of which this process 1× {own:.2f} GiB; the largest other (a worker, or Prefect's server) 1× {other:.2f} GiB."
        in page
    )
