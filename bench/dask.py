"""Dask clusters: stock clusters beside gpulab's hub-owned ones, in the same run (issue 17's
measurement contract).

- local anchor: `distributed.LocalCluster(processes=True)` as it ships, in this process (its
  scheduler in-process, each worker a process of its own under a nanny);
- local gpulab: a real hub on the embedded default (the shipped config, `GPUSimpleLocalSpawner`,
  simulated GPUs: a declared inventory of two A100s and a quota of both), clusters through
  `/hub/api/gpulab/users/{user}/dask-clusters` with the user's own token, as
  `gpulab.dask.GPUCluster` does: POST the spec, fetch `credentials` once the scheduler runs and
  connect a `distributed.Client` over the cluster's mutual TLS; workers on a 1/4-GPU profile,
  processes of the user's account;
- Kubernetes anchor: stock dask-kubernetes `KubeCluster` (the operator's `DaskCluster`) on a
  private dev cluster (`gpulab.devcluster`: real control plane, pods run as processes by the
  node agent; one node of two A100s time-sliced four ways), with the operator as gpulab runs it
  (`tests.harness.dask_kube`). Its spec is `make_cluster_spec`'s with this Python as the
  containers' command and one `nvidia.com/gpu.shared` per worker; its scheduler Service is a
  NodePort, since this host cannot resolve a Service's name (KubeCluster would then
  port-forward through the API server);
- Kubernetes gpulab: a hub with `GPUKubeSpawner` on that dev cluster (time-slicing, a 1/4-GPU
  profile), clusters through the same REST calls.

A side that cannot run (its warm-up fails, or this checkout lacks it) is a row saying why, and
its backend's ratio is n/a. Known: the stock KubeCluster fails on the dev cluster's Kubernetes
1.20.2, because kr8s 0.20.15 (dask-kubernetes' client; it supports 1.28 to 1.35) builds kinds
from discovery's `singularName`, which Kubernetes before 1.27 leaves empty: it looks `pods` up
as "/v1", gets generic objects, and `Service.ready()` raises TypeError (kr8s PR #651).

Per backend, rounds alternate anchor and gpulab (order flipped every round; one untimed warm-up
each). A round on one side: cluster-up (from the call that asks for a cluster of N workers to a
client connected to its scheduler seeing N workers), scale to 0 (untimed, until the scheduler
has no worker), then scale 0->N (the scale call to N workers seen) and N->0 (the scale call to
none seen), then shutdown. Both sides are timed the same way: the client's clock around their
own calls, readiness polled every `POLL_SECONDS` through a `distributed.Client` on the
scheduler. Before 0->N, gpulab's side also waits (untimed) until no retired worker holds its
share any more, so that both start from nothing. Leaked: after the last shutdown of a backend (at least `--leak-wait` seconds, 60 by
the contract, after it), the worker and scheduler processes still alive (local: the pids each
scheduler reported, and on gpulab's side every process of the user's account running dask) or
pods of the clusters still present (Kubernetes: pods labelled `dask.org/cluster-name`).

    .venv/bin/python -m bench.dask [--small] [--workers 4] [--rounds 10] [--leak-wait 60]
                                   [--no-kube] [--no-local]                      (as root)

Last line: local_up_ratio=<gpulab p50 / anchor p50, cluster-up> kube_up_ratio=<same or n/a>
leaked=<n, both backends, both sides>. Targets: both ratios <= 1.2, leaked 0.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil
from traitlets.config import Config

from bench._spawning import percentile

USER = "bench"
PROFILE = "gpu-quarter"
#: simulated GPUs, as the Dask tests use, and a quota of both: the default one (1 GPU) would
#: refuse a scale to N=4 quarter workers while the shares of workers just retired are still held
#: (each keeps its share until its process is gone); everything else is the shipped default
GPULAB_OVERLAY = Config(
    GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB", "default_user_quota_gpus": 2}
)
#: readiness is polled this often on every side
POLL_SECONDS = 0.05
#: one step (up, scale) longer than this is a failure, not a measurement
STEP_TIMEOUT = 300.0
#: the label the dask-kubernetes operator puts on every pod of a cluster
CLUSTER_LABEL = "dask.org/cluster-name"
#: the stock KubeClusters' names (gpulab's clusters are named by gpulab's backend)
STOCK_PREFIX = "bench-stock-"
#: Kubernetes: two A100s time-sliced four ways (eight quarter shares: N workers of either side)
KUBE_SHARE_RESOURCE = "nvidia.com/gpu.shared"
KUBE_PROFILE = "a100-quarter"  # one of tests.harness.kube's profiles
KUBE_OVERLAY = Config(
    GPUKubeSpawner={"gpu_sharing": "time-slicing"}, GPUCapacity={"default_user_quota_gpus": 8}
)


class BenchError(RuntimeError):
    """A side could not do what it was asked (the message says what happened)."""


# -- what every side does ----------------------------------------------------------------------


@dataclass
class Leftovers:
    """What must be gone after a shutdown: process ids (with their start times, so that a
    reused pid is not counted) and Kubernetes pod label selectors, and when it shut down."""

    pids: dict[int, float] = field(default_factory=dict)
    #: (namespace, label selector) of pods that must be gone
    pods: list[tuple[str, str]] = field(default_factory=list)
    #: processes of this account running dask must be gone (gpulab local: the owner's account)
    account_uid: int | None = None
    shut_at: float = 0.0


class Running(Protocol):
    """One running cluster of a side."""

    def scale(self, n: int) -> None: ...

    def count(self) -> int:
        """Workers the scheduler has now."""
        ...

    def record(self) -> None:
        """Note the workers' processes (untimed: it runs a function on each worker)."""
        ...

    def settle(self) -> None:
        """Wait until the workers that left are gone entirely (untimed)."""
        ...

    def close(self) -> Leftovers: ...


class Side(Protocol):
    name: str
    label: str

    def up(self, n: int) -> Running:
        """A cluster asked for with ``n`` workers; returns once its scheduler answers."""
        ...

    def leaked(self, left: list[Leftovers]) -> tuple[int, list[str]]:
        """How many of ``left`` are still there, and a line for each."""
        ...


def wait_count(cluster: Running, n: int, what: str, timeout: float = STEP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while (seen := cluster.count()) != n:
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: the scheduler has {seen} workers after {timeout} s, not {n}")
        time.sleep(POLL_SECONDS)


def scheduler_workers(client: Any) -> dict[str, Any]:
    """The scheduler's workers (address -> info), all of them (the default lists only a few)."""
    return dict(client.scheduler_info(n_workers=-1)["workers"])


def record_pids(client: Any, pids: dict[int, float]) -> None:
    """Add the process ids (and start times) of the scheduler's workers to ``pids``."""
    for pid in client.run(os.getpid).values():
        if pid not in pids and (started := start_time(pid)) is not None:
            pids[pid] = started


def start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def live_pids(left: list[Leftovers]) -> list[str]:
    return [
        f"process {pid} still runs {s.shut_at and time.time() - s.shut_at:.0f} s after shutdown"
        for s in left
        for pid, started in s.pids.items()
        if start_time(pid) == started
    ]


# -- local anchor: distributed.LocalCluster ------------------------------------------------------


class LocalRunning:
    def __init__(self, n: int) -> None:
        from distributed import Client, LocalCluster

        self.cluster = LocalCluster(
            n_workers=n,
            processes=True,
            threads_per_worker=1,
            dashboard_address=":0",  # as gpulab's, a dashboard; any free port
        )
        self.client = Client(self.cluster)
        self.pids: dict[int, float] = {}

    def scale(self, n: int) -> None:
        self.cluster.scale(n)

    def count(self) -> int:
        return len(scheduler_workers(self.client))

    def record(self) -> None:
        record_pids(self.client, self.pids)

    def settle(self) -> None:
        pass  # the scheduler has no worker left: nothing else holds a place

    def close(self) -> Leftovers:
        self.client.close()
        self.cluster.close()
        return Leftovers(pids=dict(self.pids), shut_at=time.time())


class LocalAnchor:
    name = "anchor"

    def __init__(self) -> None:
        self.label = f"distributed {version('distributed')} LocalCluster (stock)"

    def up(self, n: int) -> Running:
        return LocalRunning(n)

    def leaked(self, left: list[Leftovers]) -> tuple[int, list[str]]:
        lines = live_pids(left)
        return len(lines), lines


# -- gpulab through the hub's REST API -------------------------------------------------------------


class GpulabClusters:
    """The user's dask-clusters collection, with her own token (decision 0003's contract)."""

    def __init__(self, base_url: str, token: str, user: str, tmp: Path, profile: str) -> None:
        self.profile = profile
        self.http = httpx.Client(
            base_url=f"{base_url}/hub/api/gpulab/users/{user}",
            headers={"Authorization": f"token {token}"},
            timeout=60,
        )
        self.tmp = tmp

    def call(self, method: str, path: str, ok: int = 200, **kw: Any) -> dict[str, Any]:
        r = self.http.request(method, f"/dask-clusters{path}", **kw)
        if r.status_code != ok:
            raise BenchError(f"{method} dask-clusters{path}: {r.status_code} {r.text}")
        return dict(r.json())

    def credentials(self, cluster_id: int, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        """The scheduler's address and TLS material, once it runs (409 until then)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.http.get(f"/dask-clusters/{cluster_id}/credentials")
            if r.status_code == 200:
                return dict(r.json())
            ended = r.status_code == 409 and self.call("GET", f"/{cluster_id}")["state"] in (
                "failed",
                "stopped",
            )
            if r.status_code != 409 or ended or time.monotonic() > deadline:
                state = self.http.get(f"/dask-clusters/{cluster_id}").text
                raise BenchError(f"credentials of cluster {cluster_id}: {r.status_code} {state}")
            time.sleep(POLL_SECONDS)


class GpulabRunning:
    def __init__(self, api: GpulabClusters, n: int, seq: int) -> None:
        from distributed import Client
        from distributed.security import Security

        self.api = api
        body = {"name": f"bench-{seq}", "profile": api.profile, "n_workers": n}
        t0 = time.perf_counter()
        self.id = int(api.call("POST", "", ok=201, json=body)["id"])
        creds = api.credentials(self.id)
        #: from the POST to the scheduler answering (the hub gives credentials only then)
        self.scheduler_s: float | None = time.perf_counter() - t0
        # the cluster's certificate is its own CA; files of this run's private folder
        cert, key = api.tmp / f"{self.id}.pem", api.tmp / f"{self.id}.key"
        for path, text in ((cert, creds["tls_cert"]), (key, creds["tls_key"])):
            path.touch(mode=0o600)
            path.write_text(text)
        security = Security(
            tls_ca_file=str(cert),
            tls_client_cert=str(cert),
            tls_client_key=str(key),
            require_encryption=True,
        )
        self.client = Client(creds["scheduler_address"], security=security, timeout=60)
        self.pids: dict[int, float] = {}

    def scale(self, n: int) -> None:
        self.api.call("PATCH", f"/{self.id}", json={"n_workers": n})

    def count(self) -> int:
        return len(scheduler_workers(self.client))

    def record(self) -> None:
        record_pids(self.client, self.pids)

    def settle(self, timeout: float = STEP_TIMEOUT) -> None:
        # a retiring worker keeps its share (and counts against quota) until its process ends
        deadline = time.monotonic() + timeout
        while any(
            w["state"] in ("admitted", "running", "retiring")
            for w in self.api.call("GET", f"/{self.id}")["workers"]
        ):
            if time.monotonic() > deadline:
                raise BenchError(f"cluster {self.id}: workers still hold shares after {timeout} s")
            time.sleep(POLL_SECONDS)

    def close(self) -> Leftovers:
        self.client.close()
        cluster = self.api.call("DELETE", f"/{self.id}")  # answers once nothing of it runs
        if cluster["state"] not in ("stopped", "failed"):
            raise BenchError(f"cluster {self.id} is {cluster['state']} after its DELETE")
        return Leftovers(pids=dict(self.pids), shut_at=time.time())


class GpulabLocal:
    name = "gpulab"
    label = "gpulab (hub-owned, local backend)"

    def __init__(self, api: GpulabClusters, account_uid: int) -> None:
        self.api = api
        self.account_uid = account_uid
        self.seq = 0

    def up(self, n: int) -> Running:
        self.seq += 1
        return GpulabRunning(self.api, n, self.seq)

    def leaked(self, left: list[Leftovers]) -> tuple[int, list[str]]:
        lines = live_pids(left)
        # imported here: the stock LocalCluster's spawned workers import this module again, and
        # an import of gpulab's executor at the top would slow the anchor down
        from gpulab.spawner.local.dask import FORKSERVER_MODULE

        # any dask process of the owner's account: a scheduler, a nanny, a worker's child; not
        # her fork server, which holds no share and no cluster and ends by itself once idle
        # (spawner/local/dask.py)
        for proc in psutil.process_iter(["uids", "cmdline", "pid"]):
            with suppress(psutil.Error):
                uids, cmdline = proc.info["uids"], " ".join(proc.info["cmdline"] or ())
                mine = uids and uids.real == self.account_uid
                if mine and "dask" in cmdline and FORKSERVER_MODULE not in cmdline:
                    line = f"process {proc.pid} of {USER}: {cmdline[:100]}"
                    if not any(line.startswith(f"process {proc.pid} ") for line in lines):
                        lines.append(line)
        return len(lines), lines


# -- Kubernetes: stock KubeCluster and gpulab on the dev cluster ----------------------------------


def kube_node() -> Any:
    from gpulab.devcluster import NodeSpec

    return NodeSpec(
        "bench-a100",
        gpus=2,
        sharing="time-slicing",
        replicas=4,
        cpu=64,
        memory_gib=256,
        zone="zone-a",
        rack="rack-1",
    )


def kube_unavailable() -> str | None:
    """Why the Kubernetes phase cannot run in this checkout, or None when it can."""
    try:
        from gpulab.hub.daskservice.executor import RunsDaskClusters
        from gpulab.spawner.kube.spawner import GPUKubeSpawner
    except ImportError as e:
        return f"gpulab[kube] is not installed ({e})"
    if not isinstance(GPUKubeSpawner, RunsDaskClusters):
        return "the Kubernetes backend runs no Dask clusters yet (GPUKubeSpawner.dask_executor)"
    try:
        from gpulab.devcluster import DevCluster  # noqa: F401
        from gpulab.spawner.kube import dask_operator  # noqa: F401
    except ImportError as e:
        return f"cannot run the dev cluster's operator here ({e.name} missing)"
    return None


def stock_cluster_spec(name: str, n: int) -> dict[str, Any]:
    """dask-kubernetes' own spec (``make_cluster_spec``) with the commands as this machine runs
    them (the node agent runs a container's command as a process: this Python, not an image's
    entrypoint) and each worker on one time-sliced GPU share, as gpulab's quarter profile."""
    from dask_kubernetes.operator import make_cluster_spec

    spec: dict[str, Any] = make_cluster_spec(
        name, n_workers=n, worker_command=[sys.executable, "-m", "distributed.cli.dask_worker"]
    )
    (scheduler,) = spec["spec"]["scheduler"]["spec"]["containers"]
    scheduler["args"] = [
        sys.executable,
        "-m",
        "distributed.cli.dask_scheduler",
        "--host",
        "0.0.0.0",
    ]
    (worker,) = spec["spec"]["worker"]["spec"]["containers"]
    worker["resources"] = {"limits": {KUBE_SHARE_RESOURCE: "1"}}
    return spec


class KubeRunning:
    def __init__(self, n: int, seq: int, namespace: str) -> None:
        from dask_kubernetes.operator import KubeCluster
        from distributed import Client

        self.name = f"{STOCK_PREFIX}{seq}"
        self.namespace = namespace
        self.cluster = KubeCluster(
            custom_cluster_spec=stock_cluster_spec(self.name, n),
            namespace=namespace,
            shutdown_on_close=True,
            # outside the cluster: the scheduler at a node's address, as kube-proxy forwards it
            # (ClusterIP would resolve a Service name this host cannot, then port-forward)
            scheduler_service_type="NodePort",
            quiet=True,
        )
        self.client = Client(self.cluster)

    def scale(self, n: int) -> None:
        self.cluster.scale(n)

    def count(self) -> int:
        return len(scheduler_workers(self.client))

    def record(self) -> None:
        pass  # pods run in namespaces of their own: the pods are what is looked for

    def settle(self) -> None:
        pass

    def close(self) -> Leftovers:
        self.client.close()
        self.cluster.close()
        return Leftovers(
            pods=[(self.namespace, f"{CLUSTER_LABEL}={self.name}")], shut_at=time.time()
        )


class KubeAnchor:
    name = "anchor"

    def __init__(
        self,
        namespace: str,
        pods: Callable[[str, str], list[str]],
        delete_cluster: Callable[[str, str], None],
    ) -> None:
        self.label = f"dask-kubernetes {version('dask_kubernetes')} KubeCluster (stock)"
        self.namespace = namespace
        self.pods = pods
        self.delete_cluster = delete_cluster
        self.seq = 0

    def up(self, n: int) -> Running:
        self.seq += 1
        try:
            return KubeRunning(n, self.seq, self.namespace)
        except BaseException:
            # a KubeCluster that failed to start leaves its DaskCluster (and pods) behind
            from dask_kubernetes.operator import KubeCluster

            name = f"{STOCK_PREFIX}{self.seq}"
            with suppress(Exception):
                self.delete_cluster(self.namespace, name)
            # deleted here: its exit-time reaper would try again once the dev cluster is gone
            for instance in list(KubeCluster._instances):
                if getattr(instance, "name", None) == name:
                    KubeCluster._instances.discard(instance)
            raise

    def leaked(self, left: list[Leftovers]) -> tuple[int, list[str]]:
        lines = [
            f"pod {ns}/{pod} still there"
            for s in left
            for ns, selector in s.pods
            for pod in self.pods(ns, selector)
        ]
        return len(lines), lines


class GpulabKube(GpulabLocal):
    label = "gpulab (hub-owned, Kubernetes backend)"

    def __init__(self, api: GpulabClusters, pods: Callable[[str, str], list[str]]) -> None:
        super().__init__(api, account_uid=-1)
        self.pods = pods

    def leaked(self, left: list[Leftovers]) -> tuple[int, list[str]]:
        # every pod of a Dask cluster in any namespace but the stock ones: the user's clusters
        # are the only ones gpulab's hub runs on this private dev cluster
        selector = CLUSTER_LABEL
        lines = [
            f"pod {pod} still there"
            for pod in self.pods("", selector)
            if not pod.split("/", 1)[1].startswith(STOCK_PREFIX)
        ]
        return len(lines), lines


# -- the measurement -----------------------------------------------------------------------------


@dataclass
class Times:
    up: list[float] = field(default_factory=list)
    scale_up: list[float] = field(default_factory=list)
    scale_down: list[float] = field(default_factory=list)
    #: part of cluster-up: until the scheduler answers (gpulab's side: its credentials)
    scheduler: list[float] = field(default_factory=list)
    left: list[Leftovers] = field(default_factory=list)
    #: the warm-up's cluster-up: the run's first cluster (gpulab's side starts the owner's fork
    #: server with it; the anchor imports the dashboard with it)
    first_up: list[float] = field(default_factory=list)


@dataclass
class Backend:
    """One backend's two sides and what they measured."""

    title: str
    sides: list[Side] = field(default_factory=list)
    times: dict[str, Times] = field(default_factory=dict)
    leaked: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    note: str = ""  # why it was not measured
    #: side name -> why that side was not measured
    missing: dict[str, str] = field(default_factory=dict)


def timed(step: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def scale_to(cluster: Running, n: int, what: str) -> None:
    cluster.scale(n)
    wait_count(cluster, n, what)


def one_round(side: Side, n: int) -> tuple[tuple[float, float, float, float | None], Leftovers]:
    """Up to ``n``, down to 0, 0->n, n->0, shutdown: (up, 0->n, n->0, scheduler answering)
    seconds (the last None where the side does not tell), leftovers."""
    holder: list[Running] = []

    def up() -> None:
        holder.append(side.up(n))
        wait_count(holder[0], n, f"{side.label}: cluster-up")

    try:
        up_s = timed(up)
        cluster = holder[0]
        cluster.record()
        cluster.scale(0)
        wait_count(cluster, 0, f"{side.label}: settle at 0")
        cluster.settle()
        scale_up_s = timed(lambda: scale_to(cluster, n, f"{side.label}: scale 0->N"))
        cluster.record()
        scale_down_s = timed(lambda: scale_to(cluster, 0, f"{side.label}: scale N->0"))
    except BaseException:
        if holder:
            with suppress(Exception):
                holder[0].close()
        raise
    scheduler_s = getattr(cluster, "scheduler_s", None)
    return (up_s, scale_up_s, scale_down_s, scheduler_s), cluster.close()


def measure(backend: Backend, n: int, rounds: int, leak_wait: float) -> None:
    """Warm-ups, then ``rounds`` alternating rounds; then the leaks, ``leak_wait`` s after the
    last shutdown (a warm-up's leftovers count too)."""
    for side in list(backend.sides):
        try:
            (first_up, *_), left = one_round(side, n)
        except Exception as e:  # the table says why; the other side is still measured
            backend.missing[side.name] = f"the warm-up failed: {type(e).__name__}: {e}"[:300]
            backend.sides.remove(side)
            continue
        backend.times[side.name] = Times(left=[left], first_up=[first_up])
    for i in range(rounds):
        order = backend.sides if i % 2 == 0 else list(reversed(backend.sides))
        for side in order:
            (up_s, scale_up_s, scale_down_s, scheduler_s), left = one_round(side, n)
            times = backend.times[side.name]
            times.up.append(up_s)
            times.scale_up.append(scale_up_s)
            times.scale_down.append(scale_down_s)
            if scheduler_s is not None:
                times.scheduler.append(scheduler_s)
            times.left.append(left)
    last = max((s.shut_at for t in backend.times.values() for s in t.left), default=0.0)
    time.sleep(max(0.0, last + leak_wait - time.time()))
    for side in backend.sides:
        backend.leaked[side.name] = side.leaked(backend.times[side.name].left)


# -- the table -------------------------------------------------------------------------------------


def _stats(values: list[float]) -> str:
    if not values:
        return f"{0:>4} {'':>8} {'':>8} {'':>8}"
    return (
        f"{len(values):>4} {statistics.median(values):>8.3f} {percentile(values, 0.95):>8.3f} "
        f"{max(values):>8.3f}"
    )


WIDTH = 80


def print_backend(backend: Backend, n: int) -> float | None:
    """The backend's rows; returns its cluster-up ratio (gpulab p50 / anchor p50) or None."""
    if backend.note:
        for what in ("cluster-up", "scale 0->N", "scale N->0"):
            print(
                f"{backend.title + ': ' + what:<{WIDTH}} {_stats([])}  not measured: {backend.note}"
            )
        print(f"{backend.title + ': leaked after shutdown':<{WIDTH}} {'n/a':>4}")
        return None
    labels = {s.name: s.label for s in backend.sides}
    up_ratio: float | None = None
    for what, pick in (
        (f"cluster-up to {n} workers", lambda t: t.up),
        (f"scale 0->{n}", lambda t: t.scale_up),
        (f"scale {n}->0", lambda t: t.scale_down),
    ):
        for name in ("anchor", "gpulab"):
            if name in backend.missing:
                label = f"{backend.title}: {what}, {name}"
                print(f"{label:<{WIDTH}} {_stats([])}  not measured: {backend.missing[name]}")
            else:
                label = f"{backend.title}: {what}, {labels[name]}"
                print(f"{label:<{WIDTH}} {_stats(pick(backend.times[name]))}")
        if not backend.missing:
            a, g = pick(backend.times["anchor"]), pick(backend.times["gpulab"])
            p50 = statistics.median(g) / statistics.median(a)
            p95 = percentile(g, 0.95) / percentile(a, 0.95)
            print(
                f"{backend.title + ': ' + what + ', ratio gpulab/anchor':<{WIDTH}} "
                f"{'':>4} {p50:>8.3f} {p95:>8.3f}"
            )
            if what.startswith("cluster-up"):
                up_ratio = p50
        if what.startswith("cluster-up") and "gpulab" in backend.times:
            label = f"{backend.title}: {what}, gpulab: of it, POST to scheduler answering"
            print(f"{label:<{WIDTH}} {_stats(backend.times['gpulab'].scheduler)}")
            for name, times in backend.times.items():
                label = f"{backend.title}: {what}, the run's first (warm-up), {labels[name]}"
                print(f"{label:<{WIDTH}} {_stats(times.first_up)}")
    for name, (count, lines) in backend.leaked.items():
        shut = len(backend.times[name].left)
        print(
            f"{backend.title + ': leaked after shutdown, ' + labels[name]:<{WIDTH}} "
            f"{count:>4}  of {shut - 1} timed clusters and 1 warm-up; target 0"
        )
        for line in lines[:20]:
            print(f"    {line}")
    return up_ratio


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"


# -- the runs ------------------------------------------------------------------------------------


@contextmanager
def local_backend(root: Path, gpulab: bool) -> Iterator[Backend]:
    """The local backend's sides (gpulab's through a hub of its own), torn down after."""
    backend = Backend("local")
    backend.sides.append(LocalAnchor())
    if not gpulab:
        yield backend
        return
    from tests.harness.hub import Hub
    from tests.harness.jobs import user_client

    hub = Hub(root / "gpulab", GPULAB_OVERLAY)
    try:
        hub.start()
        hub.create_user(USER)
        hub.start_server(USER, profile="cpu")  # makes her account and home
        hub.stop_server(USER)  # clusters need no server (keep_alive is not needed either)
        token = user_client(hub, USER).headers["Authorization"].removeprefix("token ")
        creds = root / "credentials"
        creds.mkdir(mode=0o700)
        api = GpulabClusters(hub.url, token, USER, creds, PROFILE)
        backend.sides.append(GpulabLocal(api, hub.account(USER).pw_uid))
        yield backend
    except BaseException:
        print(hub.log()[-3000:], file=sys.stderr)
        raise
    finally:
        hub.close()
        hub.cleanup()


def run_kube(  # pragma: no cover
    root: Path, n: int, rounds: int, leak_wait: float, anchor: bool = True
) -> Backend:
    """Both Kubernetes sides on a private dev cluster with the dask-kubernetes operator (the
    CRDs and operator process as gpulab runs them; see ``kube_unavailable``)."""
    from tests.harness.cluster import running_dev_cluster
    from tests.harness.dask_kube import running_dask_operator
    from tests.harness.hub import Hub, merged
    from tests.harness.jobs import user_client
    from tests.harness.kube import KUBE_HUB_OVERLAY, kube_hub_overlay

    backend = Backend("kube")
    with (
        running_dev_cluster(root / "dev-cluster", [kube_node()]) as cluster,
        running_dask_operator(cluster, root / "dask-operator.log"),
    ):
        os.environ.update(cluster.env())  # the stock KubeCluster finds the cluster by it

        def pods(namespace: str, selector: str) -> list[str]:
            path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
            found = cluster.api("GET", f"{path}?labelSelector={selector}")
            return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in found["items"]]

        def delete_cluster(namespace: str, name: str) -> None:
            group = "/apis/kubernetes.dask.org/v1"
            cluster.api("DELETE", f"{group}/namespaces/{namespace}/daskclusters/{name}")

        overlay = kube_hub_overlay(cluster, merged(KUBE_HUB_OVERLAY, KUBE_OVERLAY))
        hub = Hub(root / "gpulab-kube", overlay)
        try:
            hub.start()
            hub.create_user(USER)
            token = user_client(hub, USER).headers["Authorization"].removeprefix("token ")
            creds = root / "kube-credentials"
            creds.mkdir(mode=0o700)
            api = GpulabClusters(hub.url, token, USER, creds, KUBE_PROFILE)
            if anchor:
                backend.sides.append(KubeAnchor("default", pods, delete_cluster))
            else:
                backend.missing["anchor"] = "--no-kube-anchor"
            backend.sides.append(GpulabKube(api, pods))
            measure(backend, n, rounds, leak_wait)
        except BaseException:
            print(hub.log()[-3000:], file=sys.stderr)
            operator_log = root / "dask-operator.log"
            print(operator_log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            hub.close()
            hub.cleanup()
    return backend


def gpulab_local_unavailable() -> str | None:
    """Why gpulab's local side cannot run in this checkout, or None when it can."""
    try:
        from gpulab.hub.daskservice.executor import RunsDaskClusters
        from gpulab.hub.daskservice.hub import GPUDask  # noqa: F401
        from gpulab.spawner.local.spawner import GPUSimpleLocalSpawner
    except ImportError as e:
        return f"no hub Dask service in this checkout ({e.name})"
    if not isinstance(GPUSimpleLocalSpawner, RunsDaskClusters):
        return "the local backend runs no Dask clusters yet (GPUSimpleLocalSpawner.dask_executor)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small sizes (a few minutes)")
    parser.add_argument("--workers", type=int, default=None, help="N, workers per cluster (4)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per side (10)")
    parser.add_argument(
        "--leak-wait", type=float, default=None, help="seconds after shutdown to look (60)"
    )
    parser.add_argument("--no-kube", action="store_true", help="skip the Kubernetes backend")
    parser.add_argument("--no-local", action="store_true", help="skip the local backend")
    parser.add_argument(
        "--no-kube-anchor", action="store_true", help="Kubernetes: gpulab's side only (no ratio)"
    )
    args = parser.parse_args(argv)
    s = args.small
    n = args.workers if args.workers is not None else (2 if s else 4)
    rounds = args.rounds if args.rounds is not None else (2 if s else 10)
    leak_wait = args.leak_wait if args.leak_wait is not None else 60.0
    if os.geteuid() != 0:
        print("bench.dask: gpulab runs clusters as each user's own account; run it as root")
        return 2

    load0 = os.getloadavg()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-dask-") as tmp:
        root = Path(tmp)
        why_not_local = gpulab_local_unavailable()
        if args.no_local:
            local = Backend("local", note="--no-local")
        else:
            with local_backend(root, gpulab=why_not_local is None) as local:
                if why_not_local is not None:
                    local.missing["gpulab"] = why_not_local
                # without gpulab's side, the anchor alone: its numbers are there, gpulab's rows
                # say why not
                with main_module_as_in_a_notebook():
                    measure(local, n, rounds, leak_wait)
        why_not_kube = "--no-kube" if args.no_kube else kube_unavailable()
        if why_not_kube is None:
            kube = run_kube(root, n, rounds, leak_wait, anchor=not args.no_kube_anchor)
        else:
            kube = Backend("kube", note=why_not_kube)

    print(f"{'measure':<{WIDTH}} {'n':>4} {'p50 s':>8} {'p95 s':>8} {'max s':>8}  note")
    local_ratio = print_backend(local, n)
    kube_ratio = print_backend(kube, n)
    leaked = sum(count for b in (local, kube) for count, _ in b.leaked.values())
    load1 = os.getloadavg()
    print(
        f"{n} workers per cluster, {rounds} timed rounds per side, leaks looked for "
        f"{leak_wait:.0f} s after the last shutdown; {os.cpu_count()} CPUs; 1-min load "
        f"{load0[0]:.2f} at the start, {load1[0]:.2f} at the end; "
        f"{time.monotonic() - t_start:.0f} s in all"
    )
    print(f"local_up_ratio={_fmt(local_ratio)} kube_up_ratio={_fmt(kube_ratio)} leaked={leaked}")
    sys.stdout.flush()
    return 0


@contextmanager
def main_module_as_in_a_notebook() -> Iterator[None]:
    """The stock LocalCluster's workers are spawned, and a spawned process imports its parent's
    ``__main__`` again. In a notebook that is the kernel's, which has no file: they import
    nothing. Run as ``python -m bench.dask`` it would be this bench (0.3 s of imports per
    worker, which would slow the anchor down): while the local backend is measured, a bare
    module stands in for it, as in a notebook (this module's functions keep their own globals;
    nothing of it is pickled to workers)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


if __name__ == "__main__":
    raise SystemExit(main())
