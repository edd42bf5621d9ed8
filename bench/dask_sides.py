"""bench.dask's sides on the local backend, and what every side does: the stock LocalCluster, and
gpulab's hub-owned clusters through the hub's REST API (`GpulabClusters`, also the Kubernetes
gpulab side's client, `bench.dask_kube`).

Apart from the run (`bench.dask`) and the measurement (`bench.dask_measure`) because each side is
a small protocol of its own (`Side.up` a cluster, `Running.scale`/`count`/`close` it, then what
is `leaked`): the measurement times any side the same way through it.
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil

USER = "bench"
#: readiness is polled this often on every side
POLL_SECONDS = 0.05
#: one step (up, scale) longer than this is a failure, not a measurement
STEP_TIMEOUT = 300.0


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
