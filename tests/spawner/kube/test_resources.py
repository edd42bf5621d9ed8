"""Profile -> pod resources for each sharing backend, and Node objects -> allocator inventory."""

from __future__ import annotations

import base64

import pytest

from gpulab.spawner.kube.gpu_resources import KubeProfileError, gpu_spec, mig_profile_for
from gpulab.spawner.kube.nodes import inventory_from_nodes, node_from_k8s
from gpulab.spawner.kube.objects import (
    CHECKPOINT_KEY_FIELD,
    checkpoint_key_mount,
    checkpoint_key_secret_manifest,
    checkpoint_key_volume,
    container_security_context,
    dns_name,
    home_pvc_manifest,
    pod_security_context,
    related_pod_affinity,
    safe_label_value,
    seccomp_profile,
    singleuser_network_policy,
    snapshot_name,
    volume_snapshot_manifest,
    workspace_id,
)
from gpulab.spawner.kube.quantities import quantity_bytes
from gpulab.spawner.kube.snapshots import snapshot_listing, snapshots_to_delete

A100 = 81920


@pytest.mark.parametrize(
    ("milli", "profile"),
    [(125, "1g.10gb"), (250, "2g.20gb"), (375, "3g.40gb"), (500, "4g.40gb"), (875, "7g.80gb")],
)
def test_smallest_mig_profile_that_holds_the_share(milli, profile):
    assert mig_profile_for(A100, milli) == profile


def test_mig_on_a_40gb_gpu():
    assert mig_profile_for(40960, 125) == "1g.5gb"
    assert mig_profile_for(40960, 500) == "4g.20gb"


def _spec(**kw):
    base = dict(
        num_gpu=0,
        gpu_milli=0,
        gpu_models=(),
        gpu_memory_mib=A100,
        sharing="mig",
        priority="on-demand",
    )
    base.update(kw)
    return gpu_spec(**base)


def test_whole_gpus_ask_for_nvidia_gpu_with_model_affinity_and_node_pin():
    spec = _spec(num_gpu=2, gpu_models={"A100-SXM4-80GB"}, node_name="gpu-node-1")
    assert spec.limits == {"nvidia.com/gpu": "2"}
    (term,) = spec.node_affinity_required
    assert {
        "key": "nvidia.com/gpu.product",
        "operator": "In",
        "values": ["NVIDIA-A100-SXM4-80GB"],
    } in term["matchExpressions"]
    assert {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-1"]} in term[
        "matchExpressions"
    ]
    assert spec.priority_class_name == "gpulab-on-demand"
    assert "Exclusive" in spec.isolation


def test_each_sharing_backend_states_its_isolation():
    mig = _spec(gpu_milli=250, sharing="mig")
    hami = _spec(gpu_milli=250, sharing="hami")
    shared = _spec(gpu_milli=250, sharing="time-slicing")
    assert mig.limits == {"nvidia.com/mig-2g.20gb": "1"}
    assert hami.limits == {
        "nvidia.com/gpu": "1",
        "nvidia.com/gpumem": "20480",
        "nvidia.com/gpucores": "25",
    }
    assert shared.limits == {"nvidia.com/gpu.shared": "1"}
    # GFD renames a time-sliced node's product; the pod must still match it
    on_a100 = _spec(gpu_milli=250, sharing="time-slicing", gpu_models={"A100-SXM4-80GB"})
    (term,) = on_a100.node_affinity_required[0]["matchExpressions"]
    assert term["values"] == ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB-SHARED"]
    assert "hardware-isolated" in mig.isolation
    assert "HAMi" in hami.isolation
    assert "no memory or fault isolation" in shared.isolation


def test_preemptible_profiles_tolerate_the_spot_pool_and_use_their_priority_class():
    spec = _spec(num_gpu=1, priority="preemptible")
    assert spec.tolerations == [
        {"key": "gpulab.io/spot", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert spec.priority_class_name == "gpulab-preemptible"
    assert _spec(num_gpu=1).tolerations == []


def test_unknown_sharing_backend_is_refused():
    with pytest.raises(KubeProfileError, match="gpu_sharing must be one of"):
        _spec(gpu_milli=125, sharing="vgpu")


def _node(name, gpus, *, ready=True, product="NVIDIA-A100-SXM4-80GB", unschedulable=False):
    return {
        "metadata": {
            "name": name,
            "labels": {
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.memory": str(A100),
                "gpulab.io/rack": "r1",
            },
        },
        "spec": {"unschedulable": unschedulable},
        "status": {
            "allocatable": {
                "cpu": "64",
                "memory": "512Gi",
                "nvidia.com/gpu": str(gpus),
                "pods": "110",
            },
            "conditions": [{"type": "Ready", "status": "True" if ready else "Unknown"}],
        },
    }


def test_node_objects_become_allocator_nodes():
    node = node_from_k8s(_node("n1", 8))
    assert node.name == "n1" and node.cpu_milli == 64000 and node.memory_mib == 512 * 1024
    assert len(node.gpus) == 8 and {g.model for g in node.gpus} == {"A100-SXM4-80GB"}
    assert {g.memory_mib for g in node.gpus} == {A100}
    assert len({g.uuid for g in node.gpus}) == 8


def test_only_ready_schedulable_nodes_are_inventory():
    inv = inventory_from_nodes(
        [_node("a", 8), _node("b", 8, ready=False), _node("c", 4, unschedulable=True)]
    )
    assert [n.name for n in inv.nodes] == ["a"]


def test_related_pods_prefer_one_rack_then_one_zone():
    rack, zone = related_pod_affinity("alice")
    assert (
        rack["podAffinityTerm"]["topologyKey"] == "gpulab.io/rack"
        and rack["weight"] > zone["weight"]
    )
    assert zone["podAffinityTerm"]["topologyKey"] == "topology.kubernetes.io/zone"
    assert rack["podAffinityTerm"]["labelSelector"]["matchExpressions"][0]["values"] == ["alice"]
    assert safe_label_value("bob@example.org/") == "bob-example.org"
    assert len(safe_label_value("x" * 100)) == 63


def test_a_label_value_is_ascii_whatever_the_username():
    # the API server refuses a non-ASCII label value, and with it the pod that carries it
    assert safe_label_value("ådä@example.org") == "d--example.org"


# -- workspace volumes ---------------------------------------------------------------------------

DAY = 86400.0
NOW = 1_780_000_000.0  # 2026-05-28


def test_home_pvc_from_a_snapshot_names_it_as_data_source():
    pvc = home_pvc_manifest(
        "gpulab-home-ada-r1",
        storage="10Gi",
        storage_class="gpulab-local",
        labels={"gpulab.io/workspace": "ws-1"},
        from_snapshot="gpulab-home-ada-20261202t180512z-abc123",
    )
    assert pvc["spec"]["dataSource"] == {
        "apiGroup": "snapshot.storage.k8s.io",
        "kind": "VolumeSnapshot",
        "name": "gpulab-home-ada-20261202t180512z-abc123",
    }
    assert pvc["spec"]["storageClassName"] == "gpulab-local"
    assert pvc["spec"]["resources"] == {"requests": {"storage": "10Gi"}}
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    plain = home_pvc_manifest("gpulab-home-ada", storage="1Gi")
    assert "dataSource" not in plain["spec"] and "storageClassName" not in plain["spec"]


def test_snapshot_names_are_valid_object_names_even_for_long_claims():
    name = snapshot_name("gpulab-home-" + "x" * 300, NOW, "abc123")
    assert len(name) <= 253 and name.endswith("-20260528t202640z-abc123")
    assert name == name.lower() and name[0].isalnum()
    assert dns_name("Alice_Smith--Exp.1") == "alice-smith--exp.1"
    assert workspace_id("ada", "") != workspace_id("ada", "exp")
    assert len(workspace_id("a" * 200, "b" * 200)) <= 63


def test_volume_snapshot_manifest_and_its_listing():
    vs = volume_snapshot_manifest(
        "snap-1", "gpulab-home-ada", labels={"gpulab.io/snapshot-label": "on-stop"}
    )
    assert vs["spec"] == {"source": {"persistentVolumeClaimName": "gpulab-home-ada"}}
    assert "volumeSnapshotClassName" not in vs["spec"]  # the cluster's default class
    vs["metadata"]["annotations"]["snapshot.gpulab.io/files"] = "12"
    vs["status"] = {
        "readyToUse": True,
        "restoreSize": "2Ki",
        "creationTime": "2026-12-02T18:05:12.250000Z",
    }
    listing = snapshot_listing(vs)
    assert listing["id"] == "snap-1" and listing["label"] == "on-stop"
    assert listing["files"] == 12 and listing["bytes"] == 2048 and listing["size"] == "2.0 kB"
    assert listing["ready"] is True and listing["pvc"] == "gpulab-home-ada"
    assert listing["created"] == pytest.approx(1796234712.25)
    assert quantity_bytes("1Gi") == 1024**3 and quantity_bytes(5000) == 5000
    assert quantity_bytes("") is None and quantity_bytes("lots") is None


def test_retention_keeps_the_newest_and_one_per_recent_day():
    snaps = [
        {"id": f"d{d}-{i}", "created": NOW - d * DAY - i * 60} for d in range(10) for i in range(3)
    ]
    doomed = set(snapshots_to_delete(snaps, keep_last=2, keep_daily=3, now=NOW))
    kept = {s["id"] for s in snaps} - doomed
    assert kept == {"d0-0", "d0-1", "d1-0", "d2-0"}
    assert snapshots_to_delete(snaps, keep_last=0, keep_daily=0, now=NOW) == sorted(
        (s["id"] for s in snaps), key=lambda i: {s["id"]: s["created"] for s in snaps}[i]
    )
    with pytest.raises(ValueError):
        snapshots_to_delete(snaps, keep_last=-1, keep_daily=0)


def test_checkpoint_key_secret_carries_the_hex_key_base64_encoded():
    body = checkpoint_key_secret_manifest(
        "gpulab-checkpoint-key-ada",
        "ab" * 32,
        labels={"hub.jupyter.org/username": "ada"},
        annotations={"hub.jupyter.org/username": "ada"},
    )
    assert body["kind"] == "Secret" and body["type"] == "Opaque"
    assert body["metadata"]["name"] == "gpulab-checkpoint-key-ada"
    assert base64.b64decode(body["data"][CHECKPOINT_KEY_FIELD]).decode() == "ab" * 32


# -- tenant isolation: security contexts, the servers' NetworkPolicy, the key volume -------------


def test_pod_and_container_security_contexts_are_hardened():
    assert pod_security_context(run_as_non_root=True, seccomp="RuntimeDefault") == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container_security_context(
        run_as_non_root=True, seccomp="RuntimeDefault", drop_capabilities=["ALL"]
    ) == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "capabilities": {"drop": ["ALL"]},
    }
    assert container_security_context(
        run_as_non_root=False, seccomp="Localhost/profiles/jupyter.json", drop_capabilities=[]
    ) == {"seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/jupyter.json"}}


@pytest.mark.parametrize("bad", ["runtime/default", "Localhost", "Unconfined/x", ""])
def test_a_bad_seccomp_profile_is_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match="use RuntimeDefault, Unconfined or Localhost/<file>"):
        seccomp_profile(bad)


def test_the_servers_network_policy_admits_hub_and_proxy_and_blocks_the_metadata_address():
    policy = singleuser_network_policy(
        "gpulab-singleuser",
        pod_selector={"component": "singleuser-server", "app": "jupyterhub"},
        server_port=8888,
        hub_selector={"app": "jupyterhub", "component": "hub"},
        hub_ports=[8081, 9100, 8081],
        hub_cidrs=["10.0.0.5/32"],
        labels={"app.kubernetes.io/managed-by": "gpulab"},
    )
    assert policy == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "gpulab-singleuser",
            "labels": {"app.kubernetes.io/managed-by": "gpulab"},
        },
        "spec": {
            "podSelector": {"matchLabels": {"component": "singleuser-server", "app": "jupyterhub"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "ports": [{"port": 8888, "protocol": "TCP"}],
                    "from": [
                        {
                            "podSelector": {
                                "matchLabels": {"hub.jupyter.org/network-access-singleuser": "true"}
                            }
                        },
                        {"ipBlock": {"cidr": "10.0.0.5/32"}},
                    ],
                }
            ],
            "egress": [
                {
                    "ports": [{"port": 8081, "protocol": "TCP"}, {"port": 9100, "protocol": "TCP"}],
                    "to": [
                        {"podSelector": {"matchLabels": {"app": "jupyterhub", "component": "hub"}}},
                        {"ipBlock": {"cidr": "10.0.0.5/32"}},
                    ],
                },
                {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
                {
                    "to": [
                        {
                            "ipBlock": {
                                "cidr": "0.0.0.0/0",
                                "except": [
                                    "10.0.0.0/8",
                                    "172.16.0.0/12",
                                    "192.168.0.0/16",
                                    "127.0.0.0/8",
                                    "169.254.169.254/32",
                                ],
                            }
                        }
                    ]
                },
            ],
        },
    }


def test_without_internet_egress_the_policy_allows_only_the_hub_and_dns():
    policy = singleuser_network_policy(
        "p",
        pod_selector={"component": "singleuser-server"},
        server_port=8888,
        hub_selector={"component": "hub"},
        hub_ports=[8081],
        allow_internet=False,
    )
    assert [rule.get("to") for rule in policy["spec"]["egress"]] == [
        [{"podSelector": {"matchLabels": {"component": "hub"}}}],
        None,  # DNS: port 53 anywhere (the cluster's resolver)
    ]


def test_checkpoint_key_is_a_read_only_secret_volume_readable_by_the_fs_group():
    assert checkpoint_key_volume("gpulab-checkpoint-key-ada", "key", "key") == {
        "name": "gpulab-checkpoint-key",
        "secret": {
            "secretName": "gpulab-checkpoint-key-ada",
            "items": [{"key": "key", "path": "key"}],
            "defaultMode": 0o440,
        },
    }
    assert checkpoint_key_mount() == {
        "name": "gpulab-checkpoint-key",
        "mountPath": "/etc/gpulab/checkpoint-key",
        "readOnly": True,
    }
