"""The 128-GPU scaling model: bytes from the parameter count, time from the links, efficiency from both."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from models.mlstm import preset

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scaling.py"


@pytest.fixture
def scaling(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # benchmarks/ is no package: load the script by path, with its folder on the path for `common`.
    monkeypatch.setattr(sys, "path", [str(SCRIPT.parent), *sys.path])
    spec = importlib.util.spec_from_file_location("scaling_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_model_follows_the_parameter_count_and_the_links(scaling: ModuleType, tmp_path: Path) -> None:
    links = {"nvlink_gbps": 3600.0, "infiniband_gbps": 400.0, "grad_bytes": 4}
    one = scaling.model("paper_4096", step_seconds=0.08, step_source="t", nodes=1, gpus_per_node=1, **links)
    assert one.allreduce_seconds == 0 and one.efficiency == 1
    big = scaling.model("paper_4096", step_seconds=0.08, step_source="t", nodes=16, gpus_per_node=8, **links)
    assert big.allreduce_bytes == preset("paper_4096").num_params * 4
    # InfiniBand: 2 × 15/16 of an eighth of the bytes at 50 GB/s.
    assert big.infiniband_seconds == pytest.approx(2 * 15 / 16 * big.allreduce_bytes / 8 / 50e9)
    assert 0.9 < big.efficiency < 1 and big.speedup == pytest.approx(128 * big.efficiency)
    slower = scaling.model("paper_4096", step_seconds=0.08, step_source="t", nodes=16, gpus_per_node=8,
                           nvlink_gbps=3600.0, infiniband_gbps=100.0, grad_bytes=4)  # fmt: skip
    assert slower.efficiency < big.efficiency

    out = tmp_path / "scaling.json"
    assert scaling.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["nodes"] * report["gpus_per_node"] == 128 and report["paper_efficiency"] == 0.85
