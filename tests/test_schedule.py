"""The suite's own schedule (tests/schedule.py): pytest-xdist gets the costliest files first."""

from __future__ import annotations

from schedule import costliest_first


def test_the_costliest_files_go_first_each_keeping_its_tests_in_order() -> None:
    nodeids = ["a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "c.py::t2", "c.py::t3", "d.py::t1"]
    costs = {"a.py": 5.0, "b.py": 80.0, "d.py": 5.0}  # c.py is not in the record: a second a test
    assert costliest_first(nodeids, costs) == [
        "b.py::t1", "a.py::t1", "a.py::t2", "d.py::t1", "c.py::t1", "c.py::t2", "c.py::t3",
    ]  # fmt: skip
    assert costliest_first(nodeids, {}) == [
        "c.py::t1", "c.py::t2", "c.py::t3", "a.py::t1", "a.py::t2", "b.py::t1", "d.py::t1",
    ]  # fmt: skip
