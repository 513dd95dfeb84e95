"""A sharded checkpoint's DCP files are read as data: a forged index or stored value is refused, not run,
with no checkpoint key set (tasks/jobs/dcp_reader.py)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tasks.jobs import sharding
from tasks.jobs.dcp_reader import INDEX, ForgedIndex, read_index, read_whole


class Payload:
    """A harmless stand-in for an attacker's code: unpickling it creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def saved(directory: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and Adam saved as the training job saves a sharded checkpoint (one process)."""
    model, optimizer = trained()
    sharding.save_sharded(model, optimizer, directory)
    return model, optimizer


def test_a_real_index_reads_as_data_and_loads_back(tmp_path: Path) -> None:
    model, optimizer = saved(tmp_path / "dcp")
    index = read_index(tmp_path / "dcp" / INDEX)
    assert any(key.startswith("model.") for key in index.state_dict_metadata)
    whole = read_whole(tmp_path / "dcp")
    for name, weight in model.state_dict().items():
        assert torch.equal(whole["model"][name], weight)
    fresh, fresh_optimizer = trained()
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.zero_()
    sharding.load_sharded(fresh, fresh_optimizer, tmp_path / "dcp")
    for (name, weight), loaded in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(weight, loaded), name
    for before, after in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert all(torch.equal(before[key], after[key]) for key in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("reader", ["read_index", "consolidate", "load_sharded"])
def test_a_forged_index_is_refused_not_run(tmp_path: Path, reader: str) -> None:
    saved(tmp_path / "dcp")
    marker = tmp_path / "ran"
    (tmp_path / "dcp" / INDEX).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        ForgedIndex, match=r"\.metadata holds [a-z]+\.open, which no DCP index holds: refused, not run"
    ):
        if reader == "read_index":
            read_index(tmp_path / "dcp" / INDEX)
        elif reader == "consolidate":
            sharding.consolidate(tmp_path / "dcp", {"param_names": [], "param_groups": []})
        else:
            sharding.load_sharded(*trained(), tmp_path / "dcp")
    assert not marker.exists()


def test_a_forged_stored_value_is_refused_not_run(tmp_path: Path) -> None:
    # DCP stores a value that is not a tensor as torch.save's bytes and reads it back with
    # weights_only=False: a value whose pickle calls something must be refused there too.
    marker = tmp_path / "ran"
    dcp.save(
        {"note": Payload(marker), "w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp")
    )
    marker.unlink(missing_ok=True)
    with pytest.raises(ForgedIndex, match="not plain data"):
        read_whole(tmp_path / "dcp")
    assert not marker.exists()


def test_a_garbled_index_is_named(tmp_path: Path) -> None:
    saved(tmp_path / "dcp")
    index = tmp_path / "dcp" / INDEX
    index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(ForgedIndex, match=rf"{index} is not a DCP index"):
        read_index(index)
