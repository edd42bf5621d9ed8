"""GPUKubeSpawner in a real JupyterHub against the real dev-cluster control plane.

The cluster (etcd, kube-apiserver, kube-scheduler, kube-controller-manager) is built from
Debian's Kubernetes source once per machine and cached; gpulab's node agent runs the pods as
local processes on simulated GPU nodes. Nothing here is a fake of the Kubernetes API.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error

import httpx
import pytest
from traitlets.config import Config

from gpulab.devcluster import DevCluster
from gpulab.spawner.kube.gpu_resources import gpu_spec
from tests.harness.hub import Hub, merged, run_in_kernel
from tests.harness.kube import (
    KUBE_HUB_OVERLAY,
    SPAWNER_NODES,
    kube_hub_overlay,
    placed_pod_of,
    placed_pods,
)
from tests.harness.wait import wait_for


@pytest.fixture(scope="module")
def cluster(make_dev_cluster) -> DevCluster:
    return make_dev_cluster(SPAWNER_NODES, "gk-cluster")


@pytest.fixture
def kube_hub(make_hub, cluster: DevCluster) -> Hub:
    return make_hub(kube_hub_overlay(cluster), env={"KUBECONFIG": str(cluster.kubeconfig)})


def test_whole_gpu_server_runs_where_the_real_scheduler_put_it_and_capacity_matches(
    kube_hub, cluster
):
    hub = kube_hub
    hub.create_user("kim")
    assert hub.capacity()["a100-1"]["label"] == "1 GPU - 8 free"
    hub.start_server("kim", profile="a100-1")
    pod = placed_pod_of(cluster, "kim")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    assert pod["spec"]["nodeName"] == "gk-a100"  # bound by kube-scheduler
    assert pod["spec"]["priorityClassName"] == "gpulab-on-demand"
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert {
        "key": "nvidia.com/gpu.product",
        "operator": "In",
        "values": ["NVIDIA-A100-SXM4-80GB"],
    } in (terms["nodeSelectorTerms"][0]["matchExpressions"])
    assert pod["metadata"]["labels"]["gpulab.io/affinity-group"] == "kim"
    prestop = pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[1:] == [
        "-m",
        "gpulab.spawner.singleuser.prestop",
        "--timeout",
        "1",
    ]  # delete_grace_period 5 - 5, at least 1
    preferred = pod["spec"]["affinity"]["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert [t["podAffinityTerm"]["topologyKey"] for t in preferred] == [
        "gpulab.io/rack",
        "topology.kubernetes.io/zone",
    ]
    placement = json.loads(pod["metadata"]["annotations"]["gpulab.io/placement"])
    assert placement["request"]["owner"] == "kim"
    assert hub.capacity()["a100-1"]["label"] == "1 GPU - 7 free"
    # under gpu_sharing="mig": whole GPUs and MIG instances (the time-sliced GPU's replicas are
    # not this backend's devices, and a time-sliced GPU is never a whole one)
    assert (
        "Kubernetes: 5 nodes, 10 GPUs, 4 MIG instances or replicas"
        in hub.api("GET", "/gpulab/capacity").json()["inventory"]
    )
    hub.stop_server("kim")
    wait_for(
        "kim's pod to go",
        lambda: not [p for p in placed_pods(cluster) if "kim" in p["metadata"]["name"]],
    )
    assert hub.capacity()["a100-1"]["free"] == 8


# what the server's kernel is and may do, as JSON on one line
KERNEL_IDENTITY = """
import json, os
status = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("Cap", "NoNew")))
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
                  "status": {k: v.strip() for k, v in status.items()}}))
"""


async def test_servers_run_hardened_as_a_non_root_uid_under_the_servers_network_policy(
    kube_hub, cluster
):
    hub = kube_hub
    hub.create_user("nora")
    hub.start_server("nora", profile="cpu")
    pod = placed_pod_of(cluster, "nora")
    assert pod["spec"]["securityContext"] == {
        "fsGroup": 100,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "runAsUser": 1000,
        "runAsGroup": 100,
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "capabilities": {"drop": ["ALL"]},
    }
    # the node agent applied it: the kernel (a child of the server) is uid 1000 without privileges
    out = await run_in_kernel(hub, "nora", KERNEL_IDENTITY)
    who = json.loads(out.strip().splitlines()[-1])
    assert (who["uid"], who["gid"], who["groups"]) == (1000, 100, [100])
    assert who["status"]["NoNewPrivs"] == "1"
    assert who["status"]["CapEff"] == who["status"]["CapBnd"] == "0000000000000000"

    policy = cluster.api(
        "GET", "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/gpulab-singleuser"
    )
    selector = policy["spec"]["podSelector"]["matchLabels"]
    # gpulab's servers only: a stock KubeSpawner's pods carry the same app and component
    assert selector == {
        "component": "singleuser-server",
        "app": "jupyterhub",
        "gpulab.io/server": "true",
    }
    assert selector.items() <= pod["metadata"]["labels"].items()  # the policy covers the pod
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"port": 8888, "protocol": "TCP"}]
    assert {"ipBlock": {"cidr": f"{cluster.host_address}/32"}} in ingress["from"]
    internet = policy["spec"]["egress"][-1]["to"][0]["ipBlock"]
    assert "169.254.169.254/32" in internet["except"]
    hub.stop_server("nora")


#: a stock KubeSpawner hub with gpulab's shipped config, as bench.kube_spawn runs one beside
#: gpulab's, in the namespace where gpulab's hub keeps its servers' NetworkPolicy
STOCK_KUBESPAWNER_OVERLAY = Config(
    {
        "JupyterHub": {"spawner_class": "kubespawner.KubeSpawner"},
        "KubeSpawner": {
            "namespace": "default",
            "image": "gpulab/singleuser:dev",  # not pulled: the node agent runs cmd
            "start_timeout": 120,
            "http_timeout": 90,
            "delete_grace_period": 2,
        },
    }
)


def test_a_stock_kubespawner_hub_beside_gpulabs_starts_without_options_and_reaches_its_hub(
    make_hub, kube_hub, cluster
):
    # gpulab's hub has started a server: its servers' NetworkPolicy is in the namespace
    kube_hub.create_user("gail")
    kube_hub.start_server("gail", profile="cpu")
    stock = make_hub(
        kube_hub_overlay(cluster, STOCK_KUBESPAWNER_OVERLAY),
        name="stock",
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )
    stock.create_user("stan")
    # no options: JupyterHub's own behaviour, not gpulab's default profile (KubeSpawner without
    # a profile_list refuses any profile with a 500)
    r = stock.spawn("stan")
    assert r.status_code in (201, 202), (r.text, stock.log()[-3000:])
    stock.wait_ready("stan", timeout=150)
    # the stock server checks a token with its own hub's API: gpulab's policy must not hold
    # it to gpulab's hub's ports
    answer = httpx.get(
        f"{stock.url}/user/stan/api/status",
        headers={"Authorization": f"token {stock.token}"},
        timeout=60,
    )
    assert answer.status_code == 200, (answer.status_code, answer.text[:500])
    stock.stop_server("stan")
    kube_hub.stop_server("gail")


def test_ninth_whole_gpu_on_eight_is_refused_not_left_pending(kube_hub, cluster):
    hub = kube_hub
    for user in ("ann", "ben", "cat"):
        hub.create_user(user)
    hub.start_server("ann", profile="a100-4")
    hub.start_server("ben", profile="a100-4")
    r = hub.spawn("cat", profile="a100-1")
    assert r.status_code == 409, r.text
    assert "cannot start now" in r.json()["message"]
    assert hub.server_model("cat") is None
    assert not [p for p in placed_pods(cluster) if "cat" in p["metadata"]["name"]]  # no Pending pod


def test_on_demand_request_evicts_a_preemptible_server_who_is_told_why(kube_hub, cluster):
    hub = kube_hub
    hub.create_user("spot")
    hub.create_user("dora")
    hub.start_server("spot", profile="a100-spot-8")
    victim = placed_pod_of(cluster, "spot")
    assert victim["spec"]["priorityClassName"] == "gpulab-preemptible"
    hub.start_server("dora", profile="a100-1")
    assert placed_pod_of(cluster, "dora")["spec"]["nodeName"] == "gk-a100"
    wait_for("the preempted server to be gone", lambda: hub.server_model("spot") is None, 60)
    events = cluster.api("GET", "/api/v1/namespaces/default/events")["items"]
    assert any(
        e["reason"] == "Preempted" and e["involvedObject"]["name"] == victim["metadata"]["name"]
        for e in events
    )
    assert set(hub.allocations()) == {"dora/"}
    # the GPU-hour ledger says so too: spot's share ended as preempted, dora's is open
    wait_for(
        "the ledger to record the preemption",
        lambda: (
            {(i.holding.user, i.end_reason) for i in hub.ledger_intervals()}
            == {("spot", "preempted"), ("dora", None)}
            or None
        ),
        30,
    )
    admin = hub.login("admin", hub.admin_password())
    # the evicted user (here seen through an admin session) reads why in the picker
    page = admin.get("/hub/spawn/spot").text
    assert (
        "Your server spot/ was stopped at" in page
        and "preempted for on-demand server dora/" in page
    )


def test_lost_node_frees_its_servers_share(kube_hub, cluster):
    hub = kube_hub
    hub.create_user("tess")
    hub.start_server("tess", profile="t4-1")
    assert placed_pod_of(cluster, "tess")["spec"]["nodeName"] == "gk-t4"
    cluster.stop_node("gk-t4")
    try:
        wait_for(
            "the hub to notice tess's server is gone", lambda: hub.server_model("tess") is None, 120
        )
        assert "tess/" not in hub.allocations()
        # the ledger closes tess's share for the lost node, not as a release
        wait_for(
            "the ledger to close tess's share",
            lambda: (
                [i.end_reason for i in hub.ledger_intervals() if i.holding.user == "tess"]
                == ["node-lost"]
                or None
            ),
            30,
        )
    finally:
        cluster.start_node("gk-t4")
        wait_for("gk-t4 Ready again", lambda: hub.capacity()["t4-1"]["free"] == 1, 120)


def test_hub_restart_keeps_pods_and_their_allocations(kube_hub, cluster):
    hub = kube_hub
    hub.create_user("remy")
    hub.start_server("remy", profile="a100-quarter")
    pod = placed_pod_of(cluster, "remy")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-2g.20gb": "1"}
    before = hub.allocations()
    free_before = hub.capacity()["a100-quarter"]["free"]
    hub.stop_hub()
    hub.start()
    after = hub.allocations()
    assert after["remy/"]["gpus"] == before["remy/"]["gpus"]
    assert hub.server_model("remy")["ready"]
    assert placed_pod_of(cluster, "remy")["metadata"]["uid"] == pod["metadata"]["uid"]
    assert hub.capacity()["a100-quarter"]["free"] == free_before
    # remy's MIG slice is counted without a gap or an overlap across the restart: one open
    # interval, or (when the allocator saw its node NotReady for a moment, as a loaded machine's
    # node agent may make it) intervals that each start where the one before ended
    remys = sorted(
        (i for i in hub.ledger_intervals() if i.holding.user == "remy"), key=lambda i: i.start
    )
    assert remys[-1].open
    assert all(a.end == b.start for a, b in zip(remys, remys[1:], strict=False)), remys
    for interval in remys:
        assert interval.holding.mig_profile == "2g.20gb" and interval.holding.milli == 250
        assert interval.holding.profile == "a100-quarter" and interval.holding.workload == "server"


def test_upstream_profile_list_keeps_working_unchanged(make_hub, cluster):
    legacy = {
        "display_name": "Legacy GPU",
        "slug": "legacy",
        "default": True,
        "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}},
    }
    overlay = kube_hub_overlay(
        cluster, merged(KUBE_HUB_OVERLAY, Config({"GPUKubeSpawner": {"profile_list": [legacy]}}))
    )
    hub = make_hub(overlay, env={"KUBECONFIG": str(cluster.kubeconfig)}, name="legacy")
    hub.create_user("lee")
    hub.start_server("lee", profile="legacy")
    pod = _pod_of_any(cluster, "lee")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "gpulab.io/placement" not in (pod["metadata"].get("annotations") or {})
    hub.stop_server("lee")


def _pod_of_any(cluster: DevCluster, user: str) -> dict:
    (pod,) = [
        p
        for p in cluster.api("GET", "/api/v1/namespaces/default/pods")["items"]
        if (p["metadata"].get("annotations") or {}).get("hub.jupyter.org/username") == user
    ]
    return pod


@pytest.mark.parametrize(
    ("sharing", "model", "node"),
    [
        ("mig", "A100-SXM4-80GB", "gk-a100-mig"),
        ("hami", "L40S", "gk-l40s-hami"),
        ("time-slicing", "A100-SXM4-80GB", "gk-a100-ts"),
    ],
)
def test_each_sharing_backend_makes_pods_the_api_server_accepts_and_schedules(
    cluster, sharing, model, node
):
    spec = gpu_spec(
        num_gpu=0,
        gpu_milli=125,
        gpu_models={model},
        gpu_memory_mib=46068 if sharing == "hami" else 81920,
        sharing=sharing,
        priority="on-demand",
    )
    name = f"share-{sharing}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": spec.node_affinity_required
                    }
                }
            },
            "containers": [
                {
                    "name": "main",
                    "image": "none",
                    "command": ["sleep", "30"],
                    "resources": {"limits": spec.limits, "requests": spec.limits},
                }
            ],
        },
    }
    cluster.api("POST", "/api/v1/namespaces/default/pods", manifest)
    try:
        pod = wait_for(
            f"{name} to run",
            lambda: (
                (p := cluster.api("GET", f"/api/v1/namespaces/default/pods/{name}"))["status"].get(
                    "phase"
                )
                == "Running"
                and p
            ),
        )
        assert pod["spec"]["nodeName"] == node  # the node that offers the backend's devices
    finally:
        with contextlib.suppress(urllib.error.HTTPError):
            cluster.api(
                "DELETE", f"/api/v1/namespaces/default/pods/{name}", {"gracePeriodSeconds": 0}
            )
