"""The real kube-scheduler places GPU pods on the agent's simulated nodes."""

from __future__ import annotations

from pathlib import Path

from kubernetes_asyncio import client

from gpulab.devcluster.agent.kube import api_client
from tests.harness.kube import Kube, pod_manifest
from tests.harness.wait import wait_for


def test_scheduler_binds_eight_gpu_pods_and_leaves_the_ninth_pending(kube: Kube) -> None:
    names = [kube.name(f"gpu{i}") for i in range(9)]
    for name in names:
        kube.create_pod(pod_manifest(name, ["sleep", "600"], gpus=1, node="gpu-a"))

    def phases() -> list[str | None]:
        return [kube.phase(n) for n in names]

    wait_for("8 pods Running", lambda: phases().count("Running") == 8, timeout=90)
    pending = [n for n in names if kube.phase(n) == "Pending"]
    assert len(pending) == 1

    def unschedulable() -> str:
        conds = kube.pod(pending[0])["status"].get("conditions", [])
        return next((c.get("message", "") for c in conds if c["type"] == "PodScheduled"), "")

    message = wait_for("the 9th pod's PodScheduled=False", unschedulable)
    assert "Insufficient nvidia.com/gpu" in message
    assert kube.pod(pending[0])["spec"].get("nodeName") is None


async def test_nodes_advertise_gpu_resources_labels_taints_and_leases(dev_cluster) -> None:
    api = await api_client(str(dev_cluster.kubeconfig))
    try:
        core = client.CoreV1Api(api)
        nodes = {n.metadata.name: n for n in (await core.list_node()).items}
        a, b, spot = nodes["gpu-a"], nodes["gpu-b"], nodes["gpu-spot"]
        assert a.status.allocatable["nvidia.com/gpu"] == "8"
        assert "nvidia.com/gpumem" not in a.status.capacity  # not a HAMi node
        assert a.status.capacity["pods"] == "110"
        # one MIG-enabled GPU (instances only), one time-sliced GPU (replicas only)
        assert b.status.capacity["nvidia.com/mig-1g.10gb"] == "2"
        assert b.status.capacity["nvidia.com/mig-3g.40gb"] == "1"
        assert b.status.capacity["nvidia.com/gpu.shared"] == "4"
        assert "nvidia.com/gpu" not in b.status.capacity
        assert b.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
        assert a.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
        assert a.metadata.labels["nvidia.com/gpu.count"] == "8"
        assert b.metadata.labels["topology.kubernetes.io/zone"] == "zone-b"
        assert b.metadata.labels["gpulab.io/rack"] == "rack-2"
        assert a.metadata.labels["kubernetes.io/hostname"] == "gpu-a"
        assert [t.key for t in spot.spec.taints or []] == ["gpulab.io/spot"]
        ready = {c.type: c.status for c in a.status.conditions}
        assert ready["Ready"] == "True"
        leases = client.CoordinationV1Api(api)
        lease = await leases.read_namespaced_lease("gpu-a", "kube-node-lease")
        assert lease.spec.holder_identity == "gpu-a"
    finally:
        await api.close()


def test_spot_node_takes_only_pods_that_tolerate_its_taint(kube: Kube) -> None:
    plain, tolerant = kube.name("plain"), kube.name("tolerant")
    kube.create_pod(pod_manifest(plain, ["sleep", "600"], node="gpu-spot"))
    m = pod_manifest(tolerant, ["sleep", "600"], node="gpu-spot")
    m["spec"]["tolerations"] = [
        {"key": "gpulab.io/spot", "operator": "Exists", "effect": "NoSchedule"}
    ]
    kube.create_pod(m)
    kube.wait_phase(tolerant, "Running")

    def taint_message() -> str:
        conds = kube.pod(plain)["status"].get("conditions", [])
        return next((c.get("message", "") for c in conds if c["type"] == "PodScheduled"), "")

    assert "taint" in wait_for("the intolerant pod to be unschedulable", taint_message)


def test_heartbeats_renew_the_lease_and_the_ready_condition(kube: Kube) -> None:
    def lease_time() -> str:
        lease = kube.api(
            "GET", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/gpu-b"
        )
        return lease["spec"]["renewTime"]

    def heartbeat_time() -> str:
        conds = kube.node("gpu-b")["status"]["conditions"]
        return next(c["lastHeartbeatTime"] for c in conds if c["type"] == "Ready")

    lease, beat = lease_time(), heartbeat_time()
    wait_for("the Lease to be renewed", lambda: lease_time() != lease, 30, interval=0.5)
    wait_for("a new Ready heartbeat", lambda: heartbeat_time() != beat, 30, interval=0.5)
    assert kube.node_ready("gpu-b") == "True"


def test_gpu_pods_see_distinct_devices_as_the_device_plugin_sets_them(
    kube: Kube, tmp_path: Path
) -> None:
    names = [kube.name("dev"), kube.name("dev")]
    for name in names:
        out = tmp_path / name
        script = f'echo "$NVIDIA_VISIBLE_DEVICES" > {out}.tmp && mv {out}.tmp {out}; sleep 600'
        kube.create_pod(pod_manifest(name, ["sh", "-c", script], gpus=2, node="gpu-a"))
    for name in names:  # both running at once: devices of a finished pod are free again
        kube.wait_phase(name, "Running")
        wait_for("the devices to be written", (tmp_path / name).exists)
    seen = [set((tmp_path / n).read_text().strip().split(",")) for n in names]
    assert all(len(s) == 2 for s in seen)
    assert not seen[0] & seen[1]
    assert all(d.startswith("GPU-gpu-a-") for d in seen[0] | seen[1])
