"""The order in which pytest-xdist hands whole test files to its workers: the costliest first.

Under ``--dist loadfile`` a worker takes one file at a time, in the order the files reach the scheduler.
xdist's own order (``--loadscope-reorder``, its default) puts the files with the most tests first, which
left the files of a few long tests (the screenshots' 80 s, the Ctrl-C tests, the deployments) to the
end, where one worker ran them alone on cores the others had left idle. Longest first is the classic
rule for jobs on parallel machines (Graham's LPT): the short files fill the end. So make test passes
``--no-loadscope-reorder`` and this plugin sorts the collection.

A file's cost is its seconds in a recorded run of the suite, ``tests/costs.json`` (setup, call and
teardown of each test, module fixtures included); a file the record lacks counts a second a test.
The order changes no result, only when each file runs. Refresh the record with
``pytest -m "not long" -n 3 --dist loadfile --record-costs`` (make test's command plus the flag).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("costs.json")
UNKNOWN_S = 1.0  # a test of a file the record lacks


def costliest_first(nodeids: list[str], costs: dict[str, float]) -> list[str]:
    """``nodeids`` with the files of the highest cost first, each file's tests kept in their order."""
    tests = Counter(_file(nodeid) for nodeid in nodeids)

    def cost(path: str) -> float:
        return costs.get(path, UNKNOWN_S * tests[path])

    first_seen = {path: i for i, path in reversed(list(enumerate(_file(n) for n in nodeids)))}
    return sorted(nodeids, key=lambda n: (-cost(_file(n)), first_seen[_file(n)]))


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-costs",
        action="store_true",
        help=f"write each test file's seconds in this run to {COSTS.name} (the order of the next runs)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    costs = json.loads(COSTS.read_text()) if COSTS.exists() else {}
    order = {nodeid: i for i, nodeid in enumerate(costliest_first([i.nodeid for i in items], costs))}
    items.sort(key=lambda item: order[item.nodeid])


_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    # The controller sees every worker's reports; a worker sees its own files only.
    if session.config.getoption("record_costs") and not hasattr(session.config, "workerinput"):
        ranked = sorted(_seconds.items(), key=lambda kv: -kv[1])
        COSTS.write_text(json.dumps({path: round(s, 1) for path, s in ranked}, indent=1) + "\n")
