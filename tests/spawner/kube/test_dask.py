"""Dask clusters on Kubernetes against the real dev cluster and the real dask-kubernetes operator:
gpulab's DaskCluster and DaskWorkerGroups, placed by the real allocator over the cluster's nodes,
become a TLS scheduler and workers on GPU shares (MIG, time-slicing) that compute a real dask
array reduction for a client in this process; the workers' environment shows their share, their
pods ask for the share's device and carry their placement; another tenant's pod cannot reach the
scheduler; stop leaves no pod.

The executor gets its owner's settings as `GPUKubeSpawner.dask_target` gives them, built here
from the same real pieces (the cluster's Node objects, the allocator, `placed_pod`) without a hub:
the hub service that drives the executor is tested on its own branch."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulab.devcluster import DevCluster, NodeSpec
from gpulab.hub.allocator import Placement
from gpulab.hub.dask import Cluster, ClusterSpec, Worker, WorkerState
from gpulab.hub.dask.allocations import scheduler_request, worker_request
from gpulab.hub.daskservice.tls import make_cluster_tls
from gpulab.spawner.kube.dask import KubeDaskError, KubeDaskExecutor
from gpulab.spawner.kube.dask_settings import cluster_name
from tests.harness.dask_kube import (
    NAMESPACE,
    Backend,
    client_security,
    connect_from_pod,
    ensure_priority_classes,
    pods,
    profile_request,
    running_dask_operator,
)
from tests.harness.wait import wait_for

# gd-mig: an A100 cut into MIG slices (2g.20gb for a quarter); gd-ts: an A100 time-sliced 4 ways
NODES = [
    NodeSpec("gd-mig", gpus=1, zone="zone-a", rack="rack-1", mig={"2g.20gb": 3, "1g.10gb": 1}),
    NodeSpec("gd-ts", gpus=1, zone="zone-a", rack="rack-1", sharing="time-slicing", replicas=4),
]


@pytest.fixture(scope="module")
def cluster(
    make_dev_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevCluster]:
    dev = make_dev_cluster(NODES, "gd-cluster")
    ensure_priority_classes(dev)
    log = tmp_path_factory.mktemp("dask-operator") / "operator.log"
    with running_dask_operator(dev, log):
        yield dev


@pytest.mark.parametrize(
    ("sharing", "node", "resources", "fraction"),
    [
        ("mig", "gd-mig", {"nvidia.com/mig-2g.20gb": "1", "cpu": "1"}, "0.250"),
        ("time-slicing", "gd-ts", {"nvidia.com/gpu.shared": "1", "cpu": "1"}, "0.250"),
    ],
)
def test_a_tls_scheduler_and_two_workers_on_gpu_shares_compute_a_dask_array_reduction(
    cluster: DevCluster,
    tmp_path: Path,
    sharing: str,
    node: str,
    resources: dict[str, str],
    fraction: str,
) -> None:
    backend = Backend(cluster, sharing)
    executor = KubeDaskExecutor(target_for=backend.target)
    cluster_id = {"mig": 7, "time-slicing": 8}[sharing]
    spec = ClusterSpec(owner="alice", name=f"etl-{sharing}", profile="a100-quarter", n_workers=2)
    record = Cluster.created(cluster_id, spec, time.time())
    tls = make_cluster_tls(f"dask-alice-{cluster_id}")
    name = cluster_name("alice", cluster_id)

    async def scenario() -> dict[str, Any]:
        began = time.monotonic()
        sched_placement = backend.allocator.place(
            scheduler_request(
                "alice", frozenset(), cluster_id, cpu_milli=500, memory_mib=512, affinity_group=None
            )
        )
        started = await executor.start_scheduler(record, sched_placement, tls)
        scheduler_up = time.monotonic() - began
        profile = backend.profiles["a100-quarter"]
        handles, placements = [], []
        for number in (1, 2):
            request = worker_request(
                profile_request(profile),
                owner="alice",
                cluster_id=cluster_id,
                number=number,
                preemptible=False,
                affinity_group=None,
            )
            placement = backend.allocator.place(request)
            placements.append(placement)
            worker = Worker(cluster_id, number, WorkerState.ADMITTED, time.time())
            handles.append(
                await executor.start_worker(record, worker, placement, started.address, tls)
            )
        from distributed import Client

        security = client_security(tls, tmp_path)
        async with Client(started.address, security=security, asynchronous=True) as client:
            await client.wait_for_workers(2, timeout=120)
            workers_up = time.monotonic() - began
            import dask.array as da

            total = await client.compute(da.ones((2000, 2000), chunks=(500, 500)).sum())
            env = await client.run(
                lambda: {
                    k: v
                    for k, v in os.environ.items()
                    if k.startswith("GPULAB_") or k == "NVIDIA_VISIBLE_DEVICES"
                }
            )
            identity = await client.scheduler.identity()
            names = sorted(w["name"] for w in identity["workers"].values())
        running = [await executor.running(h) for h in [started.handle, *handles]]
        worker_pods = pods(cluster, f"dask.org/cluster-name={name},dask.org/component=worker")
        operator_objects = {
            "cluster": cluster.api(
                "GET", f"/apis/kubernetes.dask.org/v1/namespaces/{NAMESPACE}/daskclusters/{name}"
            ),
            "service": cluster.api(
                "GET", f"/api/v1/namespaces/{NAMESPACE}/services/{name}-scheduler"
            ),
            "deployment": cluster.api(
                "GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}-scheduler"
            ),
        }
        stop_began = time.monotonic()
        for handle in handles:
            await executor.stop(handle, grace_seconds=20)
        await executor.stop(started.handle, grace_seconds=30)
        stopped_in = time.monotonic() - stop_began
        left = pods(cluster, f"dask.org/cluster-name={name}")
        base = f"/namespaces/{NAMESPACE}"
        left_objects = [
            item["metadata"]["name"]
            for path in (
                f"/apis/kubernetes.dask.org/v1{base}/daskclusters",
                f"/apis/kubernetes.dask.org/v1{base}/daskworkergroups",
                f"/apis/apps/v1{base}/deployments",
                f"/api/v1{base}/services",
                f"/api/v1{base}/secrets",
                f"/apis/networking.k8s.io/v1{base}/networkpolicies",
            )
            for item in cluster.api("GET", path)["items"]
            if item["metadata"]["name"].startswith(name)
        ]
        after = [await executor.running(h) for h in [started.handle, *handles]]
        reasons = [await executor.exit_reason(h) for h in handles]
        await backend.api.close()
        print(
            f"{sharing}: scheduler up in {scheduler_up:.1f} s, 2 workers up in {workers_up:.1f} s, "
            f"stopped in {stopped_in:.1f} s"
        )
        return {
            "started": started,
            "total": total,
            "env": env,
            "names": names,
            "running": running,
            "worker_pods": worker_pods,
            "placements": placements,
            "objects": operator_objects,
            "left": left,
            "left_objects": left_objects,
            "after": after,
            "reasons": reasons,
        }

    out = asyncio.run(scenario())
    assert out["total"] == 2000 * 2000
    assert out["started"].address.startswith("tls://")
    assert out["names"] == ["w1", "w2"]
    assert out["running"] == [True, True, True]
    # the operator reconciled gpulab's DaskCluster (its status phase is the operator's: it
    # writes Pending and Running in a race of its own handlers, so either) into the scheduler's
    # Deployment and Service, owned by the DaskCluster
    assert out["objects"]["cluster"]["status"]["phase"] in ("Pending", "Running")
    assert out["objects"]["service"]["spec"]["ports"][0]["port"] == 8786
    deployment = out["objects"]["deployment"]
    (owner,) = deployment["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("DaskCluster", name)
    # every worker sees its share
    envs = sorted(out["env"].values(), key=lambda e: e["NVIDIA_VISIBLE_DEVICES"])
    assert len(envs) == 2
    for env in envs:
        assert env["GPULAB_GPU_FRACTION"] == fraction
        assert env["GPULAB_GPU_SHARING"] == sharing
        assert env["GPULAB_GPU_ENFORCEMENT"] == sharing
        assert env["NVIDIA_VISIBLE_DEVICES"]
    # two MIG slices are two devices; two time-slicing replicas share the one GPU
    devices = {env["NVIDIA_VISIBLE_DEVICES"] for env in envs}
    assert len(devices) == (2 if sharing == "mig" else 1)
    # their pods ask for the share's device on the allocator's node and carry the placement
    by_number = {p["metadata"]["labels"]["gpulab.io/dask-worker"]: p for p in out["worker_pods"]}
    assert sorted(by_number) == ["1", "2"]
    for number, placement in zip(("1", "2"), out["placements"], strict=True):
        pod = by_number[number]
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"] == resources
        assert pod["spec"]["nodeName"] == node == placement.node
        held = json.loads(pod["metadata"]["annotations"]["gpulab.io/placement"])
        assert held["request"]["id"] == f"alice/dask-{cluster_id}-w{number}"
        assert held["gpus"] == [[s.uuid, s.milli] for s in placement.gpus]
        assert container["securityContext"]["runAsUser"] == 1000
        assert pod["spec"]["automountServiceAccountToken"] is False
    # stop returned with nothing of the cluster left
    assert out["left"] == []
    assert out["left_objects"] == []
    assert out["after"] == [False, False, False]
    assert out["reasons"] == ["its DaskWorkerGroup was deleted"] * 2


def test_a_cpu_only_worker_joins_and_every_listener_of_the_clusters_pods_is_on_the_pods_address(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """A worker of a profile without GPU (its pod told it sees none) joins and computes, and
    neither its pod nor the scheduler's listens anywhere but on the pod's own address: the
    nanny's and worker's comms and the worker's HTTP server (distributed's default for it is
    every interface, `--no-dashboard` or not)."""
    backend = Backend(cluster, "mig")
    executor = KubeDaskExecutor(target_for=backend.target)
    spec = ClusterSpec(owner="alice", name="plain", profile="cpu", n_workers=1)
    record = Cluster.created(12, spec, time.time())
    tls = make_cluster_tls("dask-alice-12")
    name = cluster_name("alice", 12)

    def listeners() -> list[str]:
        """The IPv4 addresses listened on in this process's network namespace (the pod's)."""
        found = []
        for line in open("/proc/net/tcp").read().splitlines()[1:]:  # noqa: SIM115
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                raw = bytes.fromhex(local.split(":")[0])[::-1]
                found.append(".".join(str(b) for b in raw))
        return found

    async def scenario() -> dict[str, Any]:
        started = await executor.start_scheduler(
            record,
            backend.allocator.place(
                scheduler_request(
                    "alice", frozenset(), 12, cpu_milli=500, memory_mib=512, affinity_group=None
                )
            ),
            tls,
        )
        placement = backend.allocator.place(
            worker_request(
                profile_request(backend.profiles["cpu"]),
                owner="alice",
                cluster_id=12,
                number=1,
                preemptible=False,
                affinity_group=None,
            )
        )
        assert placement.gpus == ()
        worker = Worker(12, 1, WorkerState.ADMITTED, time.time())
        try:
            handle = await executor.start_worker(record, worker, placement, started.address, tls)
            from distributed import Client

            security = client_security(tls, tmp_path)
            async with Client(started.address, security=security, asynchronous=True) as client:
                await client.wait_for_workers(1, timeout=120)
                total = await client.submit(sum, range(101))
                on_worker = await client.run(listeners)
                on_scheduler = await client.run_on_scheduler(listeners)
                env = await client.run(
                    lambda: {
                        k: os.environ.get(k)
                        for k in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
                    }
                )
            await executor.stop(handle, grace_seconds=20)
        finally:
            await executor.stop(started.handle, grace_seconds=20)
            await backend.api.close()
        return {
            "total": total,
            "worker": on_worker,
            "scheduler": on_scheduler,
            "env": list(env.values()),
            "left": pods(cluster, f"dask.org/cluster-name={name}"),
        }

    out = asyncio.run(scenario())
    assert out["total"] == 5050
    assert out["env"] == [{"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}]
    ((address, bound),) = out["worker"].items()
    pod_ip = address.removeprefix("tls://").rsplit(":", 1)[0]
    # the nanny's comm, the worker's comm, the worker's HTTP server: all on the pod's address
    assert len(bound) >= 3 and set(bound) == {pod_ip}, bound
    # its comm and its dashboard: on its pod's address alone
    assert len(out["scheduler"]) >= 2 and len(set(out["scheduler"])) == 1, out["scheduler"]
    assert "0.0.0.0" not in out["scheduler"]
    assert out["left"] == []


def test_only_the_owners_pods_and_the_hub_reach_the_scheduler(cluster: DevCluster) -> None:
    backend = Backend(cluster, "mig")
    executor = KubeDaskExecutor(target_for=backend.target)
    spec = ClusterSpec(owner="alice", name="private", profile="a100-quarter", n_workers=0)
    record = Cluster.created(9, spec, time.time())
    tls = make_cluster_tls("dask-alice-9")

    async def scenario() -> tuple[str, str]:
        placement = backend.allocator.place(
            scheduler_request(
                "alice", frozenset(), 9, cpu_milli=500, memory_mib=512, affinity_group=None
            )
        )
        started = await executor.start_scheduler(record, placement, tls)
        try:
            target = started.address.removeprefix("tls://")
            user = "hub.jupyter.org/username"
            # another tenant's pod (her server's labels) is refused before TLS is even tried
            mallory = await asyncio.to_thread(
                connect_from_pod, cluster, "mallory-probe", {user: "mallory"}, target
            )
            # the owner's pods get through to the TLS handshake
            alice = await asyncio.to_thread(
                connect_from_pod, cluster, "alice-probe", {user: "alice"}, target
            )
        finally:
            await executor.stop(started.handle, grace_seconds=5)
            await backend.api.close()
        return mallory, alice

    assert asyncio.run(scenario()) == ("refused", "open")


def test_a_worker_lost_with_its_node_is_not_running_says_so_and_stops_at_once(
    cluster: DevCluster,
) -> None:
    backend = Backend(cluster, "mig")
    executor = KubeDaskExecutor(target_for=backend.target)
    spec = ClusterSpec(owner="alice", name="lossy", profile="a100-quarter", n_workers=1)
    record = Cluster.created(10, spec, time.time())
    tls = make_cluster_tls("dask-alice-10")
    name = cluster_name("alice", 10)
    request = scheduler_request(
        "alice", frozenset(), 10, cpu_milli=500, memory_mib=512, affinity_group=None
    )
    # the scheduler on the node that stays (as the allocator may place it), the worker on the
    # MIG node that fails
    scheduler_placement = Placement(request=request, node="gd-ts", gpus=(), created_at=time.time())

    async def scenario() -> tuple[bool, str, list[dict[str, Any]]]:
        started = await executor.start_scheduler(record, scheduler_placement, tls)
        worker_placement = backend.allocator.place(
            worker_request(
                profile_request(backend.profiles["a100-quarter"]),
                owner="alice",
                cluster_id=10,
                number=1,
                preemptible=False,
                affinity_group=None,
            )
        )
        assert worker_placement.node == "gd-mig"
        worker = Worker(10, 1, WorkerState.ADMITTED, time.time())
        handle = await executor.start_worker(record, worker, worker_placement, started.address, tls)
        before = await executor.running(handle)
        await asyncio.to_thread(cluster.stop_node, "gd-mig")
        try:
            deadline = time.monotonic() + 90
            while await executor.running(handle):
                assert time.monotonic() < deadline, "the worker still counts as running"
                await asyncio.sleep(0.5)
            reason = await executor.exit_reason(handle)
            # no kubelet confirms the end of a lost node's pod: stop force-deletes it
            await executor.stop(handle, grace_seconds=20)
            left = pods(cluster, f"dask.org/workergroup-name={name}-w1")
        finally:
            await asyncio.to_thread(cluster.start_node, "gd-mig")
            await executor.stop(started.handle, grace_seconds=5)
            await backend.api.close()
        return before, reason, left

    before, reason, left = asyncio.run(scenario())
    assert before is True
    assert reason == "node gd-mig was lost"
    assert left == []

    def ready() -> bool:
        node = cluster.api("GET", "/api/v1/nodes/gd-mig")
        conditions = node["status"]["conditions"]
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    wait_for("gd-mig to be Ready again", ready, 60)


def test_a_worker_whose_pod_cannot_be_made_fails_its_start_naming_why_and_leaves_nothing(
    cluster: DevCluster,
) -> None:
    # a PriorityClass the cluster lacks: the ReplicaSet's pods are refused
    backend = Backend(
        cluster, "mig", priority_classes={"on-demand": "no-such-class"}, start_timeout=20
    )
    executor = KubeDaskExecutor(target_for=backend.target)
    spec = ClusterSpec(owner="alice", name="refused", profile="a100-quarter", n_workers=1)
    record = Cluster.created(11, spec, time.time())
    tls = make_cluster_tls("dask-alice-11")
    name = cluster_name("alice", 11)

    async def scenario() -> str:
        placement = backend.allocator.place(
            scheduler_request(
                "alice", frozenset(), 11, cpu_milli=500, memory_mib=512, affinity_group=None
            )
        )
        started = await executor.start_scheduler(record, placement, tls)
        worker_placement = backend.allocator.place(
            worker_request(
                profile_request(backend.profiles["a100-quarter"]),
                owner="alice",
                cluster_id=11,
                number=1,
                preemptible=False,
                affinity_group=None,
            )
        )
        worker = Worker(11, 1, WorkerState.ADMITTED, time.time())
        try:
            with pytest.raises(KubeDaskError) as failed:
                await executor.start_worker(record, worker, worker_placement, started.address, tls)
            groups = cluster.api(
                "GET", f"/apis/kubernetes.dask.org/v1/namespaces/{NAMESPACE}/daskworkergroups"
            )["items"]
            assert [g["metadata"]["name"] for g in groups] == [f"{name}-default"]
            assert pods(cluster, f"dask.org/workergroup-name={name}-w1") == []
        finally:
            await executor.stop(started.handle, grace_seconds=5)
            await backend.api.close()
        return str(failed.value)

    message = asyncio.run(scenario())
    assert "no PriorityClass with name no-such-class was found" in message


def test_a_cluster_made_through_the_hubs_rest_api_runs_on_kubernetes_and_leaves_nothing(
    make_hub: Any, cluster: DevCluster
) -> None:
    """The whole path on Kubernetes: a hub with GPUKubeSpawner (its `dask_executor` and
    `dask_target`), the cluster service admitting each worker, the REST API with the owner's
    token, the credentials it gives, and DELETE."""
    import httpx
    from traitlets.config import Config

    from tests.harness.hub import merged
    from tests.harness.jobs import user_client
    from tests.harness.kube import KUBE_HUB_OVERLAY, kube_hub_overlay

    dask = Config(
        GPUDask={
            "admission_interval_seconds": 0.5,
            "monitor_interval_seconds": 0.5,
            "scheduler_cpu": 0.1,
            "scheduler_memory_mib": 256,
        }
    )
    hub = make_hub(
        kube_hub_overlay(cluster, merged(KUBE_HUB_OVERLAY, dask)),
        env={"KUBECONFIG": str(cluster.kubeconfig), "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "1"},
    )
    hub.create_user("alice")
    alice: httpx.Client = user_client(hub, "alice")
    alice.timeout = httpx.Timeout(120)
    began = time.monotonic()
    r = alice.post("/users/alice/dask-clusters", json={"profile": "a100-quarter", "n_workers": 2})
    assert r.status_code == 201, r.text
    cluster_id = r.json()["id"]
    path = f"/users/alice/dask-clusters/{cluster_id}"

    def running() -> dict[str, Any] | None:
        model = alice.get(path).json()
        assert model["state"] not in ("stopped", "failed"), model
        return model if model["workers_running"] == 2 else None

    model = wait_for("2 workers running", running, 180)
    up = time.monotonic() - began
    credentials = alice.get(f"{path}/credentials").json()

    async def compute() -> tuple[int, dict[str, Any]]:
        from distributed import Client
        from distributed.security import Security

        security = Security(
            require_encryption=True,
            tls_ca_file=credentials["tls_cert"],
            tls_client_cert=credentials["tls_cert"],
            tls_client_key=credentials["tls_key"],
        )
        async with Client(
            credentials["scheduler_address"], security=security, asynchronous=True
        ) as client:
            import dask.array as da

            total = await client.compute(da.ones((2000, 2000), chunks=(500, 500)).sum())
            envs = await client.run(
                lambda: {k: v for k, v in os.environ.items() if k.startswith("GPULAB_GPU")}
            )
        return int(total), envs

    total, envs = asyncio.run(compute())
    assert total == 2000 * 2000
    assert sorted(e["GPULAB_GPU_FRACTION"] for e in envs.values()) == ["0.250", "0.250"]
    assert {w["node"] for w in model["workers"]} == {"gd-mig"}
    name = cluster_name("alice", cluster_id)
    # each worker's GPU report: its token by reference to a Secret of its own, never a literal
    # of its pod; its pushes pass the clusters' NetworkPolicy and gpulab-metrics takes them
    for pod in pods(cluster, f"dask.org/cluster-name={name},dask.org/component=worker"):
        (container,) = pod["spec"]["containers"]
        (token,) = [e for e in container["env"] if e["name"] == "GPULAB_REPORT_TOKEN"]
        number = pod["metadata"]["labels"]["gpulab.io/dask-worker"]
        assert token == {
            "name": "GPULAB_REPORT_TOKEN",
            "valueFrom": {
                "secretKeyRef": {"name": f"{name}-w{number}-report", "key": "GPULAB_REPORT_TOKEN"}
            },
        }
        secret = cluster.api(
            "GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}-w{number}-report"
        )
        literal = base64.b64decode(secret["data"]["GPULAB_REPORT_TOKEN"]).decode()
        assert literal not in json.dumps(pod)
        (owner,) = secret["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("DaskWorkerGroup", f"{name}-w{number}")

    # gpulab-metrics took both workers' pushes (its own list; the admin overview matches
    # figures to the allocator's device, which a device plugin may have swapped for another)
    service = httpx.Client(
        base_url=f"{hub.url}/services/gpulab-metrics/",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )

    def pushed() -> list[dict[str, Any]] | None:
        r = service.get("api/servers")
        up = [
            s
            for s in (r.json()["servers"] if r.status_code == 200 else [])
            if s["user"] == "alice" and s["server"].startswith(f"dask-{cluster_id}-w")
        ]
        return up if len(up) == 2 and all(s["up"] and s["gpus"] for s in up) else None

    reports = wait_for("both workers' pushes taken by gpulab-metrics", pushed, 90, 0.5)
    assert sorted(s["server"] for s in reports) == [
        f"dask-{cluster_id}-w1",
        f"dask-{cluster_id}-w2",
    ]
    stop_began = time.monotonic()
    r = alice.delete(path)
    assert r.status_code == 200, r.text
    stopped = time.monotonic() - stop_began
    assert pods(cluster, f"dask.org/cluster-name={name}") == []
    secrets = cluster.api("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets")["items"]
    assert not [s for s in secrets if s["metadata"]["name"].startswith(name)]
    assert not [a for a in hub.allocations() if f"/dask-{cluster_id}-" in a]
    print(f"through the hub: 2 workers running {up:.1f} s after the POST, DELETE {stopped:.1f} s")
