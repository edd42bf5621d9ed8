"""The local Dask executor (spawner/local/dask.py) with real processes of real per-user accounts:
a scheduler and two workers as the owner compute from a client holding the cluster's
credentials; each worker sees its own GPU share; a client without them is refused; other
accounts read none of the cluster's secrets; a stop (from a "restarted hub" too) leaves nothing
running; a failed start leaves nothing running; the dask-cuda / plain worker choice."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.array as da
import pytest
from distributed import Client, Security

from gpulab.hub.allocator import GpuShare, Placement, Request
from gpulab.hub.dask import Cluster, ClusterSpec, Worker, WorkerState, worker_name
from gpulab.hub.daskservice.executor import ClusterTLS, DaskExecutor, RunsDaskClusters
from gpulab.hub.daskservice.tls import make_cluster_tls
from gpulab.spawner.environment import CAPS_HOOK_DIR
from gpulab.spawner.local.accounts import SystemAccount
from gpulab.spawner.local.dask import (
    DaskExecutorError,
    LocalDaskExecutor,
    dashboard_prefix,
    worker_args,
)
from gpulab.spawner.local.spawner import GPUSimpleLocalSpawner
from gpulab.spawner.names import (
    GPU_FRACTION_ENV,
    GPU_MEMORY_LIMIT_MIB_ENV,
    GPU_UUIDS_ENV,
)
from gpulab.spawner.singleuser.dask_worker import worker_argv
from tests.harness.accounts import pids_of_uid
from tests.harness.hub import passable_dir

HUB_SECRET = "hub-secret-9d2e7a"  # what a hub token looks like to this test
QUARTER = "GPU-11111111-2222-3333-4444-555555555555"
MIG = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


@dataclass(frozen=True)
class InventoryGPU:
    """What the inventory says of a GPU (``GPUCapacity.gpu_by_uuid``'s answer)."""

    model: str
    memory_mib: int
    mig_profile: str | None = None


INVENTORY = {
    QUARTER: InventoryGPU("NVIDIA A100-SXM4-80GB", 81920),
    MIG: InventoryGPU("NVIDIA A100-SXM4-80GB", 19968, "2g.20gb"),
}


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The hub's state directory, where accounts can pass through (pytest's tmp_path is root's
    0700)."""
    yield passable_dir(tmp_path / "hub-state")


@pytest.fixture
def alice(make_account: Any) -> SystemAccount:
    return make_account("alice")


def executor_for(state_dir: Path, account: SystemAccount, **kw: Any) -> LocalDaskExecutor:
    async def account_for(owner: str) -> tuple[SystemAccount, str]:
        assert owner == "alice"
        return account, account.home

    return LocalDaskExecutor(state_dir, account_for, INVENTORY.__getitem__, **kw)


def cluster(environment: dict[str, str] | None = None) -> Cluster:
    spec = ClusterSpec(
        owner="alice", name="etl", profile="gpu-quarter", n_workers=2, environment=environment or {}
    )
    return Cluster.created(7, spec, time.time())


def placement(allocation: str, *shares: GpuShare, cpu_milli: int = 1000) -> Placement:
    milli = shares[0].milli if shares and shares[0].milli < 1000 else 0
    request = Request(
        id=allocation,
        owner="alice",
        cpu_milli=cpu_milli,
        memory_mib=1024,
        gpu_milli=milli,
        num_gpu=0 if milli or not shares else len(shares),
    )
    return Placement(request=request, node="local", gpus=tuple(shares), created_at=time.time())


def worker(number: int) -> Worker:
    return Worker(cluster_id=7, number=number, state=WorkerState.ADMITTED, created_at=time.time())


def security(tls: ClusterTLS) -> Security:
    return Security(
        tls_ca_file=tls.cert_pem,
        tls_client_cert=tls.cert_pem,
        tls_client_key=tls.key_pem,
        require_encryption=True,
    )


def readable_by(account: SystemAccount, path: Path, command: str = "cat") -> bool:
    """Whether ``account`` can read ``path`` (tried as that account, as an attacker would)."""
    done = subprocess.run(
        [command, str(path)],
        user=account.uid,
        group=account.gid,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def accepts_without_certificate(address: str, tls: ClusterTLS) -> bool:
    """Whether the scheduler talks to a TLS client that trusts the cluster's CA but presents no
    certificate of its own (a local account that found the port)."""
    port = int(address.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cadata=tls.cert_pem)
    ctx.check_hostname = False
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
            ctx.wrap_socket(sock) as tls_sock,
        ):
            tls_sock.do_handshake()
            tls_sock.sendall(b"\0" * 8)
            return tls_sock.recv(1) != b""  # TLS 1.3: the refusal comes after the handshake
    except (OSError, ssl.SSLError):
        return False


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as e:
        return e.code


def cmdlines(uid: int) -> str:
    """Every argv of ``uid``'s processes, as any account reads them in /proc."""
    out = []
    for pid in pids_of_uid(uid):
        with contextlib.suppress(OSError):
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return "\n".join(out)


async def wait_for_workers(client: Client, n: int) -> dict[str, str]:
    """Worker address -> name, once ``n`` workers joined."""
    await client.wait_for_workers(n)
    info = await client.scheduler.identity(n_workers=-1)
    return {addr: w["name"] for addr, w in info["workers"].items()}


async def test_cluster_of_two_workers_computes_as_its_owner_with_its_shares(
    state_dir: Path, alice: SystemAccount, make_account: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", HUB_SECRET)  # the hub's: must reach no worker
    bob = make_account("bob")
    executor = executor_for(state_dir, alice)
    assert isinstance(executor, DaskExecutor)
    tls = make_cluster_tls("dask-alice-7")
    the_cluster = cluster({"OMP_NUM_THREADS": "2"})
    began = time.monotonic()
    started = await executor.start_scheduler(the_cluster, placement("alice/dask-7-scheduler"), tls)
    scheduler_up = time.monotonic() - began
    assert re.fullmatch(r"tls://127\.0\.0\.1:\d+", started.address)
    prefix = dashboard_prefix(tls)
    assert re.fullmatch(rf"http://127\.0\.0\.1:\d+/{prefix}", started.dashboard_url)
    handles = [
        await executor.start_worker(
            the_cluster,
            worker(1),
            placement("alice/dask-7-w1", GpuShare(QUARTER, 250)),
            started.address,
            tls,
        ),
        await executor.start_worker(
            the_cluster,
            worker(2),
            placement("alice/dask-7-w2", GpuShare(MIG, 1000), cpu_milli=2000),
            started.address,
            tls,
        ),
    ]
    async with Client(started.address, security=security(tls), asynchronous=True) as client:
        workers = await wait_for_workers(client, 2)
        print(
            f"scheduler up in {scheduler_up:.1f} s, "
            f"2 workers joined at {time.monotonic() - began:.1f} s"
        )
        assert sorted(workers.values()) == [worker_name(1), worker_name(2)]
        by_name = {name: addr for addr, name in workers.items()}

        total = await client.compute(da.ones((2000, 2000), chunks=(500, 500)).sum())
        assert total == 4_000_000

        def env(name: str) -> dict[str, Any]:
            return {workers[a]: v for a, v in values[name].items()}

        values = {
            name: await client.run(os.getenv, name)  # by reference: the worker's own environ
            for name in (
                "CUDA_VISIBLE_DEVICES",
                GPU_UUIDS_ENV,
                GPU_FRACTION_ENV,
                GPU_MEMORY_LIMIT_MIB_ENV,
                "OMP_NUM_THREADS",
                "JUPYTERHUB_API_TOKEN",
            )
        }
        assert env("CUDA_VISIBLE_DEVICES") == {"w1": QUARTER, "w2": MIG}
        assert env(GPU_UUIDS_ENV) == {"w1": QUARTER, "w2": MIG}
        # a quarter of a GPU is held to its share; a whole MIG instance is the worker's own
        assert env(GPU_FRACTION_ENV) == {"w1": "0.250", "w2": None}
        assert env(GPU_MEMORY_LIMIT_MIB_ENV) == {"w1": str(81920 // 4), "w2": None}
        assert env("OMP_NUM_THREADS") == {"w1": "2", "w2": "2"}
        assert env("JUPYTERHUB_API_TOKEN") == {"w1": None, "w2": None}
        assert set((await client.run(os.getuid)).values()) == {alice.uid}
        # the quarter share's worker runs the framework caps hook, as a new Python on its
        # PYTHONPATH would (it was forked warm: the fork server applies PYTHONPATH itself)
        # (find_spec answers an imported module's own spec: where it was loaded from)
        specs = await client.run(importlib.util.find_spec, "sitecustomize")
        hooks = {workers[a]: getattr(spec, "origin", None) for a, spec in specs.items()}
        assert hooks["w1"] == str(Path(CAPS_HOOK_DIR, "sitecustomize.py"))
        assert hooks["w2"] != hooks["w1"]
        info = await client.scheduler.identity(n_workers=-1)
        nthreads = {w["name"]: w["nthreads"] for w in info["workers"].values()}
        assert nthreads == {"w1": 1, "w2": 2}
        assert await client.run_on_scheduler(os.getuid) == alice.uid
        assert by_name  # both named as the hub's worker records say

        # a client without the cluster's certificate, or with another cluster's, is refused
        for other in (make_cluster_tls("dask-bob-1"),):
            with pytest.raises((OSError, TimeoutError)):
                async with Client(
                    started.address, security=security(other), asynchronous=True, timeout=3
                ):
                    pass
        assert not await asyncio.to_thread(accepts_without_certificate, started.address, tls)
        with pytest.raises((OSError, TimeoutError, ValueError)):
            async with Client(
                started.address.replace("tls://", "tcp://"), asynchronous=True, timeout=3
            ):
                pass

    # the dashboard answers under its secret prefix only (the hub's proxy is told the URL)
    assert await asyncio.to_thread(http_status, f"{started.dashboard_url}/status") == 200
    root = started.dashboard_url.rsplit("/", 1)[0]
    assert await asyncio.to_thread(http_status, f"{root}/status") == 404

    # another account reads none of the cluster's secrets: files, argv
    files = state_dir / "dask-clusters" / "cluster-7"
    for name in ("tls.key", "tls.crt", "dask.yaml"):
        assert readable_by(alice, files / name), name
        assert not readable_by(bob, files / name), name
        assert (files / name).stat().st_mode & 0o777 == 0o600
    for log in ("scheduler.log", "w1.log"):
        assert not readable_by(bob, files / log), log
    assert readable_by(alice, files, command="ls")
    assert not readable_by(bob, files, command="ls")  # nor learns the names in it
    assert not readable_by(bob, files / "run", command="ls")
    argv = cmdlines(alice.uid)
    assert "scheduler" in argv and worker_name(2) in argv
    assert prefix not in argv and "PRIVATE KEY" not in argv and HUB_SECRET not in argv

    # the scheduler and workers were forked warm by alice's fork server, each leading a session
    # of its own, titled as a cold start would be
    for handle in [*handles, started.handle]:
        forkserver = executor._forked[(handle["pid"], handle["start_ticks"])].started.pid
        assert Path(f"/proc/{handle['pid']}/stat").read_text().split(") ")[1].split()[1] == str(
            forkserver
        )

    # a restarted hub (a new executor, no parent of them) finds and stops them all; the old
    # hub's end of the fork server's socket closes with it
    await executor.close()
    restarted = executor_for(state_dir, alice)
    scheduler_handle = started.handle
    for handle in [*handles, scheduler_handle]:
        assert await restarted.running(handle)
    for handle in handles:
        await restarted.stop(handle, 5.0)
    await restarted.stop(scheduler_handle, 5.0)
    assert pids_of_uid(alice.uid) == []
    for handle in [*handles, scheduler_handle]:
        assert not await restarted.running(handle)
        assert not await executor.running(handle)
        assert await executor.exit_reason(handle) == "stopped by the hub"

    # once the cluster ended its key, config and spill go, its logs stay; a link alice planted in
    # her run/ folder is removed, never followed
    bobs = Path(bob.home) / "notes.txt"
    bobs.write_text("bob's")
    (files / "run" / "link").symlink_to(bobs)
    (files / "run" / "spill").mkdir()
    (files / "run" / "spill" / "x.bin").write_bytes(b"0" * 1024)
    await restarted.cluster_ended(cluster())
    kept = sorted(p.name for p in files.iterdir() if not p.name.endswith(".ended-by"))
    assert kept == ["scheduler.log", "w1.log", "w2.log"]  # (and why each ended)
    assert bobs.read_text() == "bob's"


async def test_first_lines_of_a_worker_log_say_where_it_runs_and_which_worker(
    state_dir: Path, alice: SystemAccount
) -> None:
    executor = executor_for(state_dir, alice)
    tls = make_cluster_tls("dask-alice-7")
    started = await executor.start_scheduler(cluster(), placement("alice/dask-7-scheduler"), tls)
    handle = await executor.start_worker(
        cluster(),
        worker(1),
        placement("alice/dask-7-w1", GpuShare(QUARTER, 250)),
        started.address,
        tls,
    )
    try:
        log = Path(handle["log"])
        while "dask worker" not in log.read_text():
            assert await executor.running(handle), log.read_text()
            await asyncio.sleep(0.1)
        text = log.read_text()
        assert f"GPU shares: {QUARTER} (0.25 GPU)" in text
        assert "plain distributed worker (dask worker): this worker holds a GPU share but" in text
    finally:
        await executor.stop(handle, 2.0)
        await executor.stop(started.handle, 2.0)
        await executor.close()
    assert pids_of_uid(alice.uid) == []


async def test_a_scheduler_that_does_not_come_up_is_stopped_and_nothing_runs(
    state_dir: Path, alice: SystemAccount
) -> None:
    executor = executor_for(state_dir, alice, start_timeout=0.0)
    with pytest.raises(DaskExecutorError, match="did not accept TLS connections within"):
        await executor.start_scheduler(
            cluster(), placement("alice/dask-7-scheduler"), make_cluster_tls("c")
        )
    assert pids_of_uid(alice.uid) == []


async def test_a_scheduler_that_exits_at_once_says_why(
    state_dir: Path, alice: SystemAccount
) -> None:
    executor = executor_for(state_dir, alice, python="/bin/false")
    with pytest.raises(DaskExecutorError, match="ended as it started: exited with status 1"):
        await executor.start_scheduler(
            cluster(), placement("alice/dask-7-scheduler"), make_cluster_tls("c")
        )
    assert pids_of_uid(alice.uid) == []


async def test_root_and_a_non_loopback_scheduler_are_refused(state_dir: Path) -> None:
    root = SystemAccount(name="root", uid=0, gid=0, home="/root")
    executor = executor_for(state_dir, root)
    with pytest.raises(DaskExecutorError, match="refusing to run a Dask scheduler as root"):
        await executor.start_scheduler(
            cluster(), placement("alice/dask-7-scheduler"), make_cluster_tls("c")
        )
    with pytest.raises(DaskExecutorError, match="tls://127.0.0.1:<port>"):
        worker_args(placement("a"), "tls://10.0.0.1:8786", 1, sys.executable)
    with pytest.raises(DaskExecutorError, match="tls://127.0.0.1:<port>"):
        worker_args(placement("a"), "--preload=evil", 1, sys.executable)


def test_worker_on_a_gpu_share_asks_for_dask_cuda_a_cpu_worker_for_a_plain_one() -> None:
    gpu = worker_args(placement("a", GpuShare(QUARTER, 250)), "tls://127.0.0.1:4000", 3, "/py")
    cpu = worker_args(placement("b", cpu_milli=2500), "tls://127.0.0.1:4000", 4, "/py")
    assert gpu[:4] == ["/py", "-m", "gpulab.spawner.singleuser.dask_worker", "--gpu"]
    assert "--gpu" not in cpu
    assert gpu[gpu.index("--name") + 1] == "w3" and cpu[cpu.index("--name") + 1] == "w4"
    assert cpu[cpu.index("--nthreads") + 1] == "3"  # 2.5 CPUs: rounded up
    assert cpu[cpu.index("--memory-limit") + 1] == "1024MiB"
    assert cpu[cpu.index("--host") + 1] == "127.0.0.1" and "--no-dashboard" in cpu

    # where the worker runs, the launcher picks: dask-cuda's only with a GPU and dask_cuda
    args = gpu[gpu.index("--") + 1 :]
    share_env = {GPU_MEMORY_LIMIT_MIB_ENV: "20480"}
    cuda, why = worker_argv(args, holds_gpu=True, dask_cuda_installed=True, environment=share_env)
    assert cuda[1:5] == ["-m", "dask", "cuda", "worker"] and "dask-cuda" in why
    assert cuda[cuda.index("--device-memory-limit") + 1] == "20480MiB"
    plain, why = worker_argv(args, holds_gpu=True, dask_cuda_installed=False, environment={})
    assert "cuda" not in plain and "dask_cuda is not installed" in why
    plain, why = worker_argv(args, holds_gpu=False, dask_cuda_installed=True, environment={})
    assert "cuda" not in plain and "holds no GPU" in why


async def test_spawner_class_runs_clusters_but_not_as_the_hubs_account(state_dir: Path) -> None:
    assert isinstance(GPUSimpleLocalSpawner, RunsDaskClusters)

    class SharedAccountSpawner:
        def server_runs_as_hub(self) -> bool:
            return True

    async def spawner_for(owner: str) -> Any:
        return SharedAccountSpawner()

    executor = GPUSimpleLocalSpawner.dask_executor(
        state_dir=str(state_dir), gpu_of=INVENTORY.__getitem__, spawner_for=spawner_for
    )
    assert isinstance(executor, DaskExecutor)
    with pytest.raises(DaskExecutorError, match="Dask clusters need an account per user"):
        await executor.start_scheduler(
            cluster(), placement("alice/dask-7-scheduler"), make_cluster_tls("c")
        )
    assert not (state_dir / "dask-clusters" / "cluster-7").exists()


async def test_a_worker_killed_from_outside_says_so_and_stop_ends_what_it_left(
    state_dir: Path, alice: SystemAccount
) -> None:
    executor = executor_for(state_dir, alice)
    tls = make_cluster_tls("dask-alice-7")
    started = await executor.start_scheduler(cluster(), placement("alice/dask-7-scheduler"), tls)
    handle = await executor.start_worker(
        cluster(), worker(1), placement("alice/dask-7-w1"), started.address, tls
    )
    async with Client(started.address, security=security(tls), asynchronous=True) as client:
        await client.wait_for_workers(1)
    os.kill(handle["pid"], signal.SIGKILL)  # the worker's nanny, as the OOM killer would
    # until the kernel has ended every thread of it (a leader thread shows "Z" in /proc before
    # its other threads are gone, and cannot be reaped until then)
    while executor.sessions.running(handle["pid"], handle["start_ticks"], handle["boot_id"]):
        await asyncio.sleep(0.05)
    await executor.stop(handle, 2.0)  # what the nanny left (its worker process) goes too
    assert not await executor.running(handle)
    assert await executor.exit_reason(handle) == "killed by SIGKILL"
    await executor.stop(started.handle, 2.0)
    await executor.close()
    assert pids_of_uid(alice.uid) == []


async def test_a_fork_server_with_no_child_ends_by_itself(
    state_dir: Path, alice: SystemAccount
) -> None:
    executor = executor_for(state_dir, alice, forkserver_idle_seconds=1.0)
    tls = make_cluster_tls("dask-alice-7")
    started = await executor.start_scheduler(cluster(), placement("alice/dask-7-scheduler"), tls)
    assert (started.handle["pid"], started.handle["start_ticks"]) in executor._forked
    await executor.stop(started.handle, 2.0)
    deadline = time.monotonic() + 30
    while pids_of_uid(alice.uid) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert pids_of_uid(alice.uid) == []
    # the next start finds it gone and makes a new one
    again = await executor.start_scheduler(cluster(), placement("alice/dask-7-scheduler"), tls)
    assert (again.handle["pid"], again.handle["start_ticks"]) in executor._forked
    await executor.stop(again.handle, 2.0)
    await executor.close()
    assert pids_of_uid(alice.uid) == []


def sleeper(account: SystemAccount) -> subprocess.Popen[bytes]:
    """A process of ``account``'s leading a session of its own (what a lie could name)."""
    return subprocess.Popen(
        ["sleep", "60"],
        user=account.uid,
        group=account.gid,
        extra_groups=[],
        start_new_session=True,
    )


async def test_a_pid_the_fork_server_did_not_start_is_never_taken(
    state_dir: Path, alice: SystemAccount, make_account: Any
) -> None:
    # alice can write to her own fork server: were it to name another tenant's process (or one
    # of hers it did not fork), the hub would stop or report that process as her scheduler
    bob = make_account("bob")
    victims = [sleeper(bob), sleeper(alice)]
    executor = executor_for(state_dir, alice)
    tls = make_cluster_tls("dask-alice-7")
    try:
        for victim in victims:
            server = await executor._forkserver(alice, alice.home)
            if server is None:  # distrusted after the first lie: retried a minute later
                executor._forkserver_failed_at.clear()
                server = await executor._forkserver(alice, alice.home)
            assert server is not None

            async def lie(*_args: Any, pid: int = victim.pid) -> int:
                return pid

            server.start = lie  # type: ignore[method-assign]
            started = await executor.start_scheduler(
                cluster(), placement("alice/dask-7-scheduler"), tls
            )
            # started cold instead; the lying fork server ended; the victim untouched
            assert started.handle["pid"] != victim.pid
            assert (started.handle["pid"], started.handle["start_ticks"]) not in executor._forked
            assert server.closed and victim.poll() is None
            await executor.stop(started.handle, 2.0)
    finally:
        for victim in victims:
            victim.kill()
            victim.wait()
        await executor.close()
    assert pids_of_uid(alice.uid) == []


def zombie_children_of_uid(uid: int) -> list[int]:
    """This process's (the hub's) children of ``uid`` that ended and were never waited for."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state == "Z" and int(ppid) == os.getpid() and entry.stat().st_uid == uid:
                found.append(int(entry.name))
    return found


async def test_a_fork_server_that_ended_leaves_no_zombie_child_of_the_hub(
    state_dir: Path, alice: SystemAccount
) -> None:
    executor = executor_for(state_dir, alice, forkserver_idle_seconds=1.0)
    tls = make_cluster_tls("dask-alice-7")
    started = await executor.start_scheduler(cluster(), placement("alice/dask-7-scheduler"), tls)
    server = executor._forked[(started.handle["pid"], started.handle["start_ticks"])]
    await executor.stop(started.handle, 2.0)
    # idle for a second, it ends by itself: the hub (this process, its parent) must wait for it
    deadline = time.monotonic() + 30
    while pids_of_uid(alice.uid) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert pids_of_uid(alice.uid) == []  # (zombies are no live process)
    while zombie_children_of_uid(alice.uid) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert zombie_children_of_uid(alice.uid) == []
    assert server.closed and server.reaped
    await executor.close()
