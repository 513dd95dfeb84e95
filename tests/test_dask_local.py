"""A local Dask cluster the project starts (``MLSTM_TASK_RUNNER=dask`` without an address) listens on
loopback only: its scheduler and its dashboard, not every interface."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

pytest.importorskip("prefect_dask")


def test_the_local_clusters_scheduler_and_dashboard_listen_on_loopback(home: Path) -> None:
    from distributed import LocalCluster

    from flows.runtime import task_runner
    from tasks.settings import get_settings

    runner = task_runner(get_settings(task_runner="dask", max_workers=1))
    # The runner's own cluster settings: the scheduler and the dashboard run in this process.
    with LocalCluster(**runner.cluster_kwargs) as cluster:
        listening = {
            conn.laddr.port: conn.laddr.ip
            for conn in psutil.Process().net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN
        }
        dashboard = cluster.scheduler.services["dashboard"].port
        assert listening[dashboard] == "127.0.0.1", listening
        assert listening[cluster.scheduler.port] == "127.0.0.1", listening
