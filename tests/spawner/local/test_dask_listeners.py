"""Where a local Dask cluster listens (spawner/local/dask_listeners.py), with real processes of a
real per-user account: every listening socket of its scheduler and worker is on 127.0.0.1, and
a worker's own HTTP server (which distributed starts even with --no-dashboard) serves no route
to anyone who reaches it there."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from gpulab.hub.daskservice.tls import make_cluster_tls
from gpulab.spawner.local.accounts import SystemAccount
from tests.harness.hub import passable_dir, pids_of_uid
from tests.harness.isolation_dask import HTTP_PATHS, listening_sockets, run_probe_here
from tests.spawner.local.test_dask_executor import (
    cluster,
    executor_for,
    placement,
    security,
    worker,
)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield passable_dir(tmp_path / "hub-state")


@pytest.fixture
def alice(make_account: Any) -> SystemAccount:
    return make_account("alice")


async def running_cluster(state_dir: Path, alice: SystemAccount) -> tuple[Any, list[Any]]:
    """A scheduler and one worker of alice's, the worker joined; (executor, handles)."""
    executor = executor_for(state_dir, alice)
    tls = make_cluster_tls("dask-alice-7")
    started = await executor.start_scheduler(cluster(), placement("alice/dask-7-scheduler"), tls)
    handle = await executor.start_worker(
        cluster(), worker(1), placement("alice/dask-7-w1"), started.address, tls
    )
    async with Client(started.address, security=security(tls), asynchronous=True) as client:
        await client.wait_for_workers(1)
    return executor, [handle, started.handle]


async def stop_all(executor: Any, handles: list[Any], alice: SystemAccount) -> None:
    for handle in handles:
        await executor.stop(handle, 2.0)
    await executor.close()
    assert pids_of_uid(alice.uid) == []


async def test_every_listening_socket_of_a_cluster_is_on_loopback(
    state_dir: Path, alice: SystemAccount
) -> None:
    executor, handles = await running_cluster(state_dir, alice)
    try:
        sockets = listening_sockets(pids_of_uid(alice.uid))
    finally:
        await stop_all(executor, handles, alice)
    # the scheduler's comm and dashboard; the worker's nanny, its comm and its HTTP server
    assert len(sockets) >= 5, sockets
    assert {address for address, _port in sockets} == {"127.0.0.1"}, sorted(sockets)


async def test_no_port_of_a_cluster_answers_http_but_the_dashboard_under_its_prefix(
    state_dir: Path, alice: SystemAccount
) -> None:
    # any local account reaches 127.0.0.1: the worker's HTTP server (metrics, health, info) must
    # answer none of its routes there, nor the dashboard without its secret prefix
    executor, handles = await running_cluster(state_dir, alice)
    try:
        ports = sorted({port for _a, port in listening_sockets(pids_of_uid(alice.uid))})
        targets = [(f"port {port}", "127.0.0.1", port, True) for port in ports]
        results = await asyncio.to_thread(run_probe_here, targets)
    finally:
        await stop_all(executor, handles, alice)
    answered = {name: r for name, r in results.items() if r.isdigit()}
    # two ports speak HTTP (the dashboard's, the worker's: the probe reached them), with 404s
    assert len(answered) == 2 * len(HTTP_PATHS), results
    assert set(answered.values()) == {"404"}, answered
    # and no comm port talks without the cluster's certificate, over TLS or plain
    assert not [name for name, r in results.items() if r == "answered"], results
