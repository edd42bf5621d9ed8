"""Profile -> pod resources for each sharing backend, and Node objects -> allocator inventory."""

from __future__ import annotations

import pytest

from gpulab.spawner.kube_resources import (
    KubeProfileError,
    gpu_spec,
    inventory_from_nodes,
    mig_profile_for,
    node_from_k8s,
    related_pod_affinity,
    safe_label_value,
)

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
            "labels": {"nvidia.com/gpu.product": product, "gpulab.io/rack": "r1"},
        },
        "spec": {"unschedulable": unschedulable},
        "status": {
            "allocatable": {
                "cpu": "64",
                "memory": "512Gi",
                "nvidia.com/gpu": str(gpus),
                "nvidia.com/gpumem": str(gpus * A100),
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
