"""Nodes as NVIDIA's device plugin, GFD and HAMi publish them -> the devices gpulab places on.

The Node objects come from the dev cluster's node builder (devcluster/spec.py), the same shapes
the e2e tests schedule against."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from gpulab.devcluster.spec import NodeSpec, capacity, node_manifest
from gpulab.hub.allocator import Allocator, NoCapacity, Request
from gpulab.hub.inventory import mig_instance_milli
from gpulab.spawner.kube.gpu_resources import model_from_product
from gpulab.spawner.kube.nodes import inventory_from_nodes, node_from_k8s


def k8s_node(spec: NodeSpec) -> dict[str, Any]:
    node = node_manifest(spec, internal_ip="127.0.0.1")
    cap = capacity(spec)
    node["status"] = {
        "capacity": cap,
        "allocatable": cap,
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    return node


MIG_NODE = NodeSpec("m", gpus=2, mig={"2g.20gb": 3, "1g.10gb": 1}, mig_gpus=1)
TS_NODE = NodeSpec("t", gpus=4, sharing="time-slicing", replicas=4)
HAMI_NODE = NodeSpec("h", gpus=2, sharing="hami")


def test_mig_instances_are_devices_of_their_profiles_part_and_the_rest_whole_gpus() -> None:
    node = node_from_k8s(k8s_node(MIG_NODE), "mig")
    parts = Counter((g.mig_profile, g.capacity_milli, g.share_step_milli) for g in node.gpus)
    assert parts == {("2g.20gb", 250, 250): 3, ("1g.10gb", 125, 125): 1, (None, 1000, 0): 1}
    assert {g.model for g in node.gpus} == {"A100-SXM4-80GB"}


def test_time_slicing_replicas_are_devices_and_the_product_loses_its_shared_suffix() -> None:
    node = node_from_k8s(k8s_node(TS_NODE), "time-slicing")
    assert len(node.gpus) == 16
    assert {(g.capacity_milli, g.share_step_milli) for g in node.gpus} == {(250, 250)}
    assert {g.model for g in node.gpus} == {"A100-SXM4-80GB"}
    assert model_from_product("NVIDIA-A100-SXM4-80GB-SHARED") == "A100-SXM4-80GB"


def test_hami_gpus_come_from_its_registration_with_their_split_step() -> None:
    node = node_from_k8s(k8s_node(HAMI_NODE), "hami")
    assert [(g.uuid, g.share_step_milli, g.memory_mib) for g in node.gpus] == [
        ("GPU-h-0", 100, 81920),
        ("GPU-h-1", 100, 81920),
    ]


def test_fractions_go_only_to_the_configured_backends_devices() -> None:
    nodes = [k8s_node(s) for s in (MIG_NODE, TS_NODE, HAMI_NODE)]
    for sharing, expected in (("mig", 4), ("time-slicing", 16), ("hami", 20)):
        alloc = Allocator(inventory_from_nodes(nodes, sharing))
        assert alloc.capacity(Request("probe", gpu_milli=100)) == expected, sharing
    # whole GPUs: the MIG node's plain GPU and both HAMi GPUs, never a part
    alloc = Allocator(inventory_from_nodes(nodes, "mig"))
    assert alloc.capacity(Request("probe", num_gpu=1)) == 3


@pytest.mark.parametrize(
    ("spec", "sharing", "milli", "slots"),
    [
        (MIG_NODE, "mig", 250, 3),  # 8 quarter-GPU requests against 3 2g.20gb instances
        (TS_NODE, "time-slicing", 125, 16),  # 64 eighth-GPU requests against 16 replicas
        (HAMI_NODE, "hami", 62, 20),  # 1/16 requests against 10 splits x 2 GPUs
    ],
)
def test_a_backend_admits_exactly_its_slots(spec: NodeSpec, sharing: str, milli: int, slots: int):
    alloc = Allocator(inventory_from_nodes([k8s_node(spec)], sharing))
    placed = 0
    for i in range(4 * slots):
        try:
            alloc.place(Request(f"u{i}/", owner=f"u{i}", gpu_milli=milli))
            placed += 1
        except NoCapacity:
            pass
    assert placed == slots


def test_a_mig_instance_is_its_memory_part_of_the_gpu() -> None:
    assert mig_instance_milli("1g.10gb", 81920) == 125
    assert mig_instance_milli("3g.40gb", 81920) == 500
    assert mig_instance_milli("7g.80gb", 81920) == 999  # never a whole GPU
    assert mig_instance_milli("1g.18gb", 143771) == 128


def test_a_pod_is_told_its_share_as_the_monitor_reads_it() -> None:
    from gpulab.spawner.kube.gpu_resources import share_environment

    def env(**kw: Any) -> dict[str, str]:
        base = {"sharing": "mig", "model": "A100-SXM4-80GB", "taken_milli": 250}
        return share_environment(**{**base, "device_memory_mib": 20480, "fractional": True, **kw})

    assert env() == {
        "GPULAB_GPU_MODEL": "A100-SXM4-80GB",
        "GPULAB_GPU_DEVICE_MEMORY_MIB": "20480",
        "GPULAB_GPU_ENFORCEMENT": "mig",
        "GPULAB_GPU_FRACTION": "0.250",
        "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
    }
    replica = env(sharing="time-slicing", device_memory_mib=81920)
    assert replica["GPULAB_GPU_MEMORY_LIMIT_MIB"] == "20480"  # its part of the GPU
    assert env(taken_milli=2000, device_memory_mib=81920, fractional=False) == {
        "GPULAB_GPU_MODEL": "A100-SXM4-80GB",
        "GPULAB_GPU_DEVICE_MEMORY_MIB": "81920",
        "GPULAB_GPU_ENFORCEMENT": "exclusive",
    }
    named = env(mig_profile="2g.20gb", inventory="simulated")
    assert named["GPULAB_GPU_MODEL"] == "A100-SXM4-80GB MIG 2g.20gb"
    assert named["GPULAB_GPU_INVENTORY"] == "simulated"
    cpu = env(model="", taken_milli=0, device_memory_mib=0, fractional=False)
    assert cpu["NVIDIA_VISIBLE_DEVICES"] == "void" and cpu["CUDA_VISIBLE_DEVICES"] == ""
