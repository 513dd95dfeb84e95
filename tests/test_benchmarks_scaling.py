"""The 128-GPU scaling model: bytes from the parameter count, time from the links, efficiency from both."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from conftest import load_benchmark

from models.mlstm import preset


@pytest.fixture
def scaling(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # benchmarks/ is no package: load the script by path, with its folder on the path for `common`.
    module = load_benchmark("scaling.py", "scaling_benchmark", monkeypatch)
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
