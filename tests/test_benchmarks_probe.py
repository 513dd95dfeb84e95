"""The probe benchmark's verdict: when the solver's answer counts as liblinear's."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest
from conftest import load_benchmark


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # benchmarks/ is no package: load the script by path, with its folder on the path for `common`.
    return load_benchmark("probe.py", "probe_benchmark", monkeypatch)


# liblinear chose 2^-1 (dev 0.8); at 2^0 its own probe scored 0.79 on dev.
BASE = {"C": 0.5, "dev_accuracy": 0.8, "test_accuracy": 0.75}
LIBLINEAR_DEV = {0.5: 0.8, 1.0: 0.79}


@pytest.mark.parametrize(
    ("C", "dev", "test", "same"),
    [
        (0.5, 0.8, 0.752, True),  # the same C
        (1.0, 0.8, 0.752, True),  # another C, the same best dev: a tie of the choice
        (1.0, 0.8, 0.76, False),  # ... but test 1 point away
        (1.0, 0.81, 0.752, False),  # another C and a better dev: not liblinear's answer
    ],
)
def test_a_dev_tie_is_the_same_best_dev_and_test_within_half_a_point(
    probe: ModuleType, C: float, dev: float, test: float, same: bool
) -> None:
    fast = SimpleNamespace(C=C, dev_accuracy=dev, test_accuracy=test)
    assert probe.same_answer(BASE, fast, LIBLINEAR_DEV) is same


def test_liblinears_own_tie_at_the_solvers_C_counts_too(probe: ModuleType) -> None:
    fast = SimpleNamespace(C=1.0, dev_accuracy=0.79, test_accuracy=0.75)
    assert probe.same_answer(BASE, fast, {0.5: 0.8, 1.0: 0.8})
    assert not probe.same_answer(BASE, fast, LIBLINEAR_DEV)
