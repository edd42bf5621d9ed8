"""GPU placeholders (the Helm chart's pause pods, per profile) hold GPUs for servers to take by
preemption: gpulab's allocator counts other workloads' GPU pods as held, but not these."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gpulab.devcluster.spec import NodeSpec, capacity, node_manifest
from gpulab.spawner.kube.state import KubeGPUState
from gpulab.spawner.names import GPU_RESOURCE, PLACEHOLDER_LABEL

NODE = NodeSpec("n1", gpus=2)


def state_with(pods: list[dict[str, Any]]) -> KubeGPUState:
    """A cluster view over one Ready 2-GPU node and `pods`, as the watches would fill it."""
    api = SimpleNamespace(list_node=None, list_pod_for_all_namespaces=None)
    state = KubeGPUState(
        api, None, policy="gpulab", headroom_fraction=0.0, quota=None, on_rebuild=lambda a, i: None
    )
    node = node_manifest(NODE, internal_ip="127.0.0.1")
    node["status"] = {
        "capacity": capacity(NODE),
        "allocatable": capacity(NODE),
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    state.nodes.objects["n1"] = node
    for pod in pods:
        state.pods.objects[f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"] = pod
    state._rebuild()
    return state


def gpu_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "gpulab", "labels": labels},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "c", "resources": {"limits": {GPU_RESOURCE: "1"}}}],
        },
        "status": {"phase": "Running"},
    }


def held(state: KubeGPUState) -> list[str]:
    return sorted(p.request.id for p in state.allocator.allocations())


def test_another_workloads_gpu_pod_holds_its_gpu() -> None:
    assert held(state_with([gpu_pod("training", {"app": "other"})])) == [
        "external/gpulab/training/0"
    ]


def test_a_placeholder_holds_nothing_the_allocator_would_not_place_on() -> None:
    pod = gpu_pod("gpulab-placeholder-gpu-1-abc", {PLACEHOLDER_LABEL: "true"})
    assert held(state_with([pod])) == []
