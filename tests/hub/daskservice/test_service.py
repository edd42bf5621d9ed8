"""The cluster service with its real parts and no hub process: a GPUCapacity on a declared
inventory (the allocator, quotas), the cluster store on SQLite, the cluster's real TLS, and real
`dask scheduler` / `dask worker` processes (tests/hub/daskservice/processes.py). Admission of
each worker on its own (waiting with the allocator's reason, admitted when a share is given
back), quota refusals, retire order, idle stop, stop with the server, and a "hub restart" (a new
service on the same store, allocations and processes)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.dask import ClusterSpec, ClusterState, ClusterStore, WorkerState
from gpulab.hub.daskservice.executor import ClusterTLS
from gpulab.hub.daskservice.hub import _make_tls
from gpulab.hub.daskservice.service import DaskRefused, DaskService
from tests.harness.wait import WaitTimeout, wait_for_async
from tests.hub.daskservice.processes import ProcessExecutor

PROFILES = [
    {"slug": "cpu", "gpus": 0, "default": True},
    {"slug": "quarter", "gpus": "1/4"},
    {"slug": "half", "gpus": "1/2"},
]


@pytest.fixture
def capacity_config(tmp_path: Path) -> Config:
    c = Config()
    c.GPUCapacity.inventory_source = "declared"
    c.GPUCapacity.declared_inventory = "1 x A100-SXM4-80GB"
    c.GPUCapacity.db_url = f"sqlite:///{tmp_path / 'alloc.sqlite'}"
    c.GPUCapacity.profiles = PROFILES
    c.GPUCapacity.user_quota_gpus = {"alice": "3/4"}
    return c


Make = Callable[..., DaskService]


@pytest.fixture
async def make_service(tmp_path: Path, capacity_config: Config) -> AsyncIterator[Make]:
    """A cluster service as a hub builds it; every call opens the same store and allocations (a
    second call is the service of a restarted hub). Teardown stops what is left."""
    executor = ProcessExecutor(tmp_path / "clusters")
    made: list[tuple[DaskService, ClusterStore]] = []
    executors = [executor]

    def make(executor: ProcessExecutor = executor, **kw: Any) -> DaskService:
        if executor not in executors:  # a test's own executor: its processes are stopped too
            executors.append(executor)
        capacity = GPUCapacity(config=capacity_config)
        store = ClusterStore(f"sqlite:///{tmp_path / 'dask.sqlite'}")
        options: dict[str, Any] = {
            "admission_interval_seconds": 0.5,
            "monitor_interval_seconds": 0.5,
            # this machine may have 2 cores: room for several schedulers
            "scheduler_cpu_milli": 100,
            "scheduler_memory_mib": 256,
        }
        options.update(kw)
        service = DaskService(store, capacity, executor, make_tls=_make_tls, **options)
        service.executor_for_tests = executor  # type: ignore[attr-defined]
        made.append((service, store))
        return service

    yield make
    for service, _store in made:
        await service.close()
    for used in executors:
        for pid in used.alive():
            with_kill(pid)
    for _service, store in made:
        store.close()


def with_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def spec(**kw: Any) -> ClusterSpec:
    values: dict[str, Any] = {"owner": "alice", "name": "etl", "profile": "quarter", "n_workers": 2}
    values.update(kw)
    return ClusterSpec(**values)


async def until(
    service: DaskService,
    cluster_id: int,
    check: Callable[[Any, list[Any]], bool],
    what: str,
    timeout: float = 90,
) -> tuple[Any, list[Any]]:
    seen: list[Any] = []

    async def probe() -> tuple[Any, list[Any]] | None:
        cluster = await asyncio.to_thread(service.store.get, cluster_id)
        workers = await asyncio.to_thread(service.store.workers, cluster_id)
        seen[:] = [cluster.state.value, [(w.name, w.state.value, w.reason) for w in workers]]
        return (cluster, workers) if check(cluster, workers) else None

    try:
        return await wait_for_async(what, probe, timeout)
    except WaitTimeout:
        raise AssertionError(f"waiting for {what}; last: {seen}") from None


def states(workers: list[Any]) -> dict[str, str]:
    return {w.name: w.state.value for w in workers}


def holders(service: DaskService) -> set[str]:
    return {p.request.id for p in service.capacity.allocator.allocations()}


async def tls_client(address: str, tls: ClusterTLS) -> Any:
    from distributed import Client
    from distributed.security import Security

    security = Security(
        require_encryption=True,
        tls_ca_file=tls.cert_pem,
        tls_client_cert=tls.cert_pem,
        tls_client_key=tls.key_pem,
    )
    return await Client(address, security=security, asynchronous=True)


async def test_a_cluster_admits_each_worker_computes_and_stops_leaving_nothing(
    make_service: Make,
) -> None:
    service = make_service()
    await service.start()
    cluster = await service.create(spec())
    assert cluster.state is ClusterState.PENDING
    cluster, workers = await until(
        service,
        cluster.id,
        lambda c, ws: (
            c.state is ClusterState.RUNNING and [w.state for w in ws] == [WorkerState.RUNNING] * 2
        ),
        "two workers to join",
    )
    assert holders(service) == {"alice/dask-1-scheduler", "alice/dask-1-w1", "alice/dask-1-w2"}
    # each worker on its own quarter of the GPU, as its environment says
    executor: ProcessExecutor = service.executor_for_tests  # type: ignore[attr-defined]
    for w in workers:
        (share,) = w.placement.gpus
        assert share.milli == 250
        assert executor.environments[f"1/{w.name}"]["CUDA_VISIBLE_DEVICES"] == share.uuid
    tls = await service.tls_of(cluster.id)
    assert tls is not None
    client = await tls_client(cluster.scheduler_address, tls)
    try:
        import dask.array as da

        total = await client.compute(da.ones((1000, 1000), chunks=(100, 100)).sum())
        assert total == 1_000_000
        who = await client.run(lambda dask_worker: dask_worker.name)
        assert sorted(who.values()) == ["w1", "w2"]
    finally:
        await client.close()
    # a certificate of another cluster is refused at the handshake
    from gpulab.hub.daskservice.tls import make_cluster_tls

    with pytest.raises(Exception):  # noqa: B017 - TLS refusals surface as OSError or TimeoutError
        stranger = await asyncio.wait_for(
            tls_client(cluster.scheduler_address, make_cluster_tls("stranger")), 15
        )
        await stranger.close()
    stopped = await service.stop(cluster.id)
    assert stopped.state is ClusterState.STOPPED
    assert holders(service) == set()  # every share free when stop returns
    assert executor.alive() == []  # nothing of it runs
    assert {w.state for w in await asyncio.to_thread(service.store.workers, cluster.id)} == {
        WorkerState.STOPPED
    }


async def test_a_worker_that_does_not_fit_waits_with_the_reason_and_starts_on_a_release(
    make_service: Make, capacity_config: Config
) -> None:
    capacity_config.GPUCapacity.user_quota_gpus = {}
    service = make_service()
    await service.start()
    # bob's server holds half of the only GPU
    from gpulab.hub.allocator import Request

    blocker = Request(id="bob/", owner="bob", gpu_milli=500)
    await service.capacity.place(blocker)
    cluster = await service.create(spec(n_workers=3))
    _c, workers = await until(
        service,
        cluster.id,
        lambda c, ws: (
            states(ws) == {"w1": "running", "w2": "running", "w3": "pending"} and bool(ws[2].reason)
        ),
        "two workers running, the third waiting",
    )
    waiting = workers[2].reason
    assert waiting.startswith("waiting for a free 1/4 GPU"), waiting
    assert service.waiting_reason(_c, workers) == waiting
    # bob stops his server: the release wakes admission, no scale needed
    await service.capacity.release("bob/")
    await until(
        service,
        cluster.id,
        lambda c, ws: states(ws) == {"w1": "running", "w2": "running", "w3": "running"},
        "the third worker to join after the release",
    )
    await service.stop(cluster.id)


async def test_beyond_quota_is_refused_whole_naming_the_limit(make_service: Make) -> None:
    service = make_service()
    await service.start()
    with pytest.raises(DaskRefused) as refused:
        await service.create(spec(n_workers=4))  # 1 GPU > 3/4 quota
    assert refused.value.status == 403 and refused.value.field == "n_workers"
    assert "your GPU quota of 0.75 GPU" in refused.value.message
    assert "at most 3 workers" in refused.value.message
    assert await asyncio.to_thread(service.store.list_clusters) == []  # nothing half-made
    assert holders(service) == set()

    cluster = await service.create(spec(n_workers=1))
    await until(service, cluster.id, lambda c, ws: states(ws) == {"w1": "running"}, "w1 to join")
    with pytest.raises(DaskRefused) as refused:
        await service.scale(cluster.id, 4)
    assert "at most 3 workers" in refused.value.message
    assert (await asyncio.to_thread(service.store.get, cluster.id)).target == 1  # unchanged
    await service.stop(cluster.id)


async def test_scale_down_retires_pending_workers_first_then_running_ones_and_frees_shares(
    make_service: Make, capacity_config: Config
) -> None:
    capacity_config.GPUCapacity.user_quota_gpus = {}
    service = make_service()
    await service.start()
    from gpulab.hub.allocator import Request

    await service.capacity.place(Request(id="bob/", owner="bob", gpu_milli=500))
    cluster = await service.create(spec(n_workers=3))
    await until(
        service,
        cluster.id,
        lambda c, ws: states(ws) == {"w1": "running", "w2": "running", "w3": "pending"},
        "w3 waiting",
    )
    await service.scale(cluster.id, 2)
    await until(
        service,
        cluster.id,
        lambda c, ws: states(ws) == {"w1": "running", "w2": "running", "w3": "stopped"},
        "the pending worker retired first",
    )
    await service.scale(cluster.id, 1)
    _c, workers = await until(
        service,
        cluster.id,
        lambda c, ws: sorted(states(ws).values()) == ["running", "stopped", "stopped"],
        "one running worker retired",
    )
    gone = [w for w in workers if w.state is WorkerState.STOPPED and w.number != 3]
    assert len(gone) == 1 and gone[0].reason == "scaled down"
    assert f"alice/dask-1-{gone[0].name}" not in holders(service)  # its share is free
    # scaled up again: a new number, never a reused one
    await service.capacity.release("bob/")
    await service.scale(cluster.id, 2)
    _c, workers = await until(
        service,
        cluster.id,
        lambda c, ws: sum(w.state is WorkerState.RUNNING for w in ws) == 2,
        "a new worker",
    )
    assert max(w.number for w in workers) == 4
    await service.stop(cluster.id)


async def test_an_idle_cluster_stops_after_its_timeout_and_server_stop_spares_kept_alive_ones(
    make_service: Make,
) -> None:
    # the hub's default idle timeout applies to clusters whose spec names none
    service = make_service(default_idle_timeout_seconds=3)
    await service.start()
    idle = await service.create(spec(name="idle", n_workers=0))
    cluster, _w = await until(
        service, idle.id, lambda c, ws: c.state is ClusterState.STOPPED, "the idle stop"
    )
    assert cluster.reason.startswith("idle for 3 s"), cluster.reason

    service2 = make_service(default_idle_timeout_seconds=3600)
    await service.close()
    await service2.start()
    with_server = await service2.create(spec(name="a", n_workers=0, server="gpu"))
    kept = await service2.create(spec(name="b", n_workers=0, server="gpu", keep_alive=True))
    other = await service2.create(spec(name="c", n_workers=0, server=""))
    for c in (with_server, kept, other):
        await until(service2, c.id, lambda c, ws: c.state is ClusterState.RUNNING, "running")
    tasks = await service2.server_stopped("alice", "gpu")
    await asyncio.gather(*tasks)
    after = {c.name: c for c in await asyncio.to_thread(service2.store.list_clusters)}
    assert after["a"].state is ClusterState.STOPPED
    assert after["a"].reason == "stopped with its server 'gpu' (not kept alive)"
    assert after["b"].state is ClusterState.RUNNING and after["c"].state is ClusterState.RUNNING
    for c in (kept, other):
        await service2.stop(c.id)


async def test_a_restarted_hub_watches_running_clusters_again_and_fails_ended_workers(
    make_service: Make,
) -> None:
    service = make_service()
    await service.start()
    cluster = await service.create(spec())
    _c, workers = await until(
        service,
        cluster.id,
        lambda c, ws: states(ws) == {"w1": "running", "w2": "running"},
        "two workers",
    )
    await service.close()  # the hub goes away; its clusters keep running
    executor: ProcessExecutor = service.executor_for_tests  # type: ignore[attr-defined]
    w2 = await asyncio.to_thread(service.store.handle, cluster.id, "w2")
    assert w2 is not None
    await executor.stop(w2, 0)  # w2 dies while the hub is away

    restarted = make_service()
    assert restarted.live_allocation_ids() >= {"alice/dask-1-scheduler", "alice/dask-1-w1"}
    await restarted.start()
    _c, workers = await until(
        restarted,
        cluster.id,
        lambda c, ws: (
            c.state is ClusterState.RUNNING
            and states(ws) == {"w1": "running", "w2": "failed", "w3": "running"}
        ),
        "w2 failed and replaced",
    )
    assert workers[1].reason.startswith("ended")
    assert "alice/dask-1-w2" not in holders(restarted)
    stopped = await restarted.stop(cluster.id)
    assert stopped.state is ClusterState.STOPPED and executor.alive() == []


async def test_an_adaptive_cluster_grows_for_work_within_quota_and_shrinks_when_idle(
    make_service: Make,
) -> None:
    service = make_service()
    await service.start()
    # up to 5 workers asked for, but alice's 3/4 GPU quota holds 3 quarter workers
    cluster = await service.create(spec(n_workers=0, minimum=0, maximum=5))
    cluster, _w = await until(
        service, cluster.id, lambda c, ws: c.state is ClusterState.RUNNING, "the scheduler"
    )
    tls = await service.tls_of(cluster.id)
    assert tls is not None
    client = await tls_client(cluster.scheduler_address, tls)
    try:
        futures = client.map(time.sleep, [0.5] * 60, pure=False)
        _c, workers = await until(
            service,
            cluster.id,
            lambda c, ws: sum(w.state is WorkerState.RUNNING for w in ws) == 3,
            "three workers for the work",
        )
        assert len([w for w in workers if w.state is not WorkerState.STOPPED]) == 3  # no more
        assert await client.gather(futures) == [None] * 60
    finally:
        await client.close()
    await until(
        service,
        cluster.id,
        lambda c, ws: not [w for w in ws if w.state is not WorkerState.STOPPED],
        "every worker retired once the work is done",
    )
    assert holders(service) == {"alice/dask-1-scheduler"}
    await service.stop(cluster.id)


async def test_preemptible_workers_give_their_share_to_on_demand_work_and_are_replaced(
    make_service: Make, capacity_config: Config
) -> None:
    capacity_config.GPUCapacity.user_quota_gpus = {}
    service = make_service()
    await service.start()
    cluster = await service.create(spec(n_workers=4, preemptible=True))
    await until(
        service,
        cluster.id,
        lambda c, ws: [w.state for w in ws] == [WorkerState.RUNNING] * 4,
        "four workers on the whole GPU",
    )
    from gpulab.hub.allocator import Request

    # bob's on-demand server needs half of the GPU: two workers make room, before it is placed
    placement = await service.capacity.place(Request(id="bob/", owner="bob", gpu_milli=500))
    assert placement.gpu_milli == 500
    _c, workers = await until(
        service,
        cluster.id,
        lambda c, ws: (
            sum(w.state is WorkerState.PREEMPTED for w in ws) == 2
            and sum(w.state is WorkerState.PENDING and bool(w.reason) for w in ws) == 2
        ),
        "two preempted workers, two replacements waiting",
    )
    preempted = [w for w in workers if w.state is WorkerState.PREEMPTED]
    assert all(w.reason.startswith("preempted for on-demand work bob/") for w in preempted)
    executor: ProcessExecutor = service.executor_for_tests  # type: ignore[attr-defined]
    for w in preempted:
        handle = await asyncio.to_thread(service.store.handle, cluster.id, w.name)
        assert handle is not None and not await executor.running(handle)
    waiting = [w for w in workers if w.state is WorkerState.PENDING]
    assert waiting[0].reason.startswith("waiting for a free 1/4 GPU"), waiting[0].reason
    await service.capacity.release("bob/")
    await until(
        service,
        cluster.id,
        lambda c, ws: sum(w.state is WorkerState.RUNNING for w in ws) == 4,
        "the replacements to run once bob's share is free",
    )
    await service.stop(cluster.id)


class WorkersThatCannotStart(ProcessExecutor):
    """Schedulers start; every worker's start fails (a broken image, a missing device)."""

    async def start_worker(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("exec format error")


async def test_workers_that_fail_to_start_are_not_replaced_forever(
    make_service: Make, tmp_path: Path
) -> None:
    service = make_service(executor=WorkersThatCannotStart(tmp_path / "broken"))
    await service.start()
    cluster = await service.create(spec(n_workers=2))
    _c, workers = await until(
        service,
        cluster.id,
        lambda c, ws: sum(w.state is WorkerState.FAILED for w in ws) >= 3,
        "three failed starts",
    )
    assert workers[0].reason == "could not start: exec format error"
    assert not [a for a in holders(service) if "-w" in a]  # no share held by a failed worker
    # a few more passes: no new worker while the pause lasts
    for _ in range(6):
        service.wake()
        await asyncio.sleep(0.5)
    later = await asyncio.to_thread(service.store.workers, cluster.id)
    assert len(later) <= 4, [(w.name, w.state.value) for w in later]
    await service.stop(cluster.id)


class GatedStopExecutor(ProcessExecutor):
    """Stops processes only once the test opens the gate: workers stay `retiring`, holding their
    shares, for as long as the test needs (a real worker may take its grace period to leave)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()

    async def stop(self, handle: Any, grace_seconds: float) -> None:
        await self.gate.wait()
        await super().stop(handle, grace_seconds)


async def test_scaling_back_up_while_workers_still_retire_is_not_refused_for_their_shares(
    make_service: Make, tmp_path: Path
) -> None:
    # alice's quota of 3/4 GPU: three quarter workers, all of it
    executor = GatedStopExecutor(tmp_path / "gated")
    service = make_service(executor=executor)
    await service.start()
    cluster = await service.create(spec(n_workers=3))
    await until(
        service,
        cluster.id,
        lambda c, ws: [w.state for w in ws] == [WorkerState.RUNNING] * 3,
        "three workers",
    )
    await service.scale(cluster.id, 0)
    await until(
        service,
        cluster.id,
        lambda c, ws: [w.state for w in ws] == [WorkerState.RETIRING] * 3,
        "three workers retiring (their stop held at the gate)",
    )
    assert len([h for h in holders(service) if "-w" in h]) == 3  # their shares are still held
    # the cluster's own shares come back to it: no 403, the new workers wait for them
    scaled = await service.scale(cluster.id, 3)
    assert scaled.target == 3
    _c, workers = await until(
        service,
        cluster.id,
        lambda c, ws: sum(w.state is WorkerState.PENDING for w in ws) == 3,
        "three new workers waiting for the retiring ones' shares",
    )
    assert all("quota" in w.reason for w in workers if w.state is WorkerState.PENDING), workers
    # a 4th would go beyond the quota whatever retires: refused whole, naming the limit
    with pytest.raises(DaskRefused) as refused:
        await service.scale(cluster.id, 4)
    assert refused.value.status == 403, refused.value
    assert "your GPU quota" in str(refused.value) and "at most 3 workers" in str(refused.value)
    executor.gate.set()
    await until(
        service,
        cluster.id,
        lambda c, ws: sum(w.state is WorkerState.RUNNING for w in ws) == 3,
        "the new workers running on the freed shares",
    )
    await service.stop(cluster.id)


async def test_workers_ask_for_the_node_of_the_notebook_they_came_from(
    make_service: Make,
) -> None:
    from gpulab.hub.allocator import Request

    service = make_service(notebook_of=lambda cluster: f"{cluster.owner}/{cluster.spec.server}")
    await service.start()
    notebook = await service.capacity.place(Request(id="alice/", owner="alice", gpu_milli=250))
    cluster = await service.create(spec(n_workers=1))
    await until(
        service,
        cluster.id,
        lambda c, ws: [w.state for w in ws] == [WorkerState.RUNNING],
        "the worker",
    )
    worker = service.capacity.allocator.get("alice/dask-1-w1")
    assert worker is not None
    assert worker.request.preferred_node == notebook.node
    assert worker.node == notebook.node
    await service.stop(cluster.id)


async def test_a_profile_that_is_not_hers_or_never_fits_is_refused_naming_the_field(
    make_service: Make, capacity_config: Config
) -> None:
    capacity_config.GPUCapacity.profiles = [*PROFILES, {"slug": "eight", "gpus": 8}]
    service = make_service()
    await service.start()
    with pytest.raises(DaskRefused) as unknown:
        await service.create(spec(profile="gpu-99"))
    assert unknown.value.status == 400 and unknown.value.field == "profile"
    assert "no profile 'gpu-99' for you; choose one of: cpu, quarter, half" in str(unknown.value)
    with pytest.raises(DaskRefused) as too_big:
        await service.create(spec(profile="eight"))
    assert too_big.value.status == 400 and "larger than any machine here" in str(too_big.value)
    assert await asyncio.to_thread(service.store.list_clusters) == []  # nothing half-made


async def test_each_gpu_worker_gets_a_report_of_its_own_allocation_and_cpu_workers_none(
    make_service: Make,
) -> None:
    asked: list[str] = []

    def report_for(allocation_id: str) -> dict[str, str]:
        # the hub's ReportTokens.issue, asked once the share is held
        asked.append(allocation_id)
        return {"GPULAB_REPORT_NAME": allocation_id.partition("/")[2]}

    service = make_service(report_for=report_for)
    await service.start()
    gpu = await service.create(spec())
    await until(
        service,
        gpu.id,
        lambda c, ws: [w.state for w in ws] == [WorkerState.RUNNING] * 2,
        "two GPU workers",
    )
    cpu = await service.create(spec(name="cpu-etl", profile="cpu", n_workers=1))
    await until(
        service,
        cpu.id,
        lambda c, ws: [w.state for w in ws] == [WorkerState.RUNNING],
        "one CPU worker",
    )
    executor: ProcessExecutor = service.executor_for_tests  # type: ignore[attr-defined]
    assert sorted(asked) == [f"alice/dask-{gpu.id}-w1", f"alice/dask-{gpu.id}-w2"]
    assert executor.reports == {
        f"{gpu.id}/w1": {"GPULAB_REPORT_NAME": f"dask-{gpu.id}-w1"},
        f"{gpu.id}/w2": {"GPULAB_REPORT_NAME": f"dask-{gpu.id}-w2"},
        f"{cpu.id}/w1": None,  # nothing to report: no token either
    }
    await service.stop(gpu.id)
    await service.stop(cpu.id)
