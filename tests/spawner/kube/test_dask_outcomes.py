"""How the Kubernetes Dask executor reads a pod's end and a node's loss from what the API server
returns (their real shapes, as dicts), and its handles."""

from __future__ import annotations

from typing import Any

import pytest

from gpulab.spawner.kube.dask_outcomes import KubeDaskHandle, container_end_reason, node_lost_for

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def pod(state: dict | None = None, last: dict | None = None) -> dict:
    status = {"name": "worker", "state": state or {"running": {}}, "lastState": last or {}}
    return {"status": {"phase": "Running", "containerStatuses": [status]}}


def test_a_containers_end_is_said_in_the_kubelets_words() -> None:
    assert container_end_reason(pod()) == ""
    assert (
        container_end_reason(pod(last={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}))
        == "OOMKilled"
    )
    assert (
        container_end_reason(pod({"terminated": {"exitCode": 1, "reason": "Error"}}))
        == "exited with status 1"
    )
    assert container_end_reason({"status": {}}) == ""


def node(ready: str, since: str = "2027-01-15T07:59:00Z") -> dict:
    return {
        "status": {"conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": since}]}
    }


def test_a_node_is_lost_for_as_long_as_it_has_not_been_ready_or_is_gone() -> None:
    assert node_lost_for(node("True"), NOW) == 0.0
    assert node_lost_for(node("Unknown"), NOW) == pytest.approx(60.0)
    assert node_lost_for(node("False", "2027-01-15T07:59:58Z"), NOW) == pytest.approx(2.0)
    assert node_lost_for(None, NOW) == float("inf")
    # as the Python client serializes it
    assert node_lost_for(node("Unknown", "2027-01-15T07:59:30+00:00"), NOW) == pytest.approx(30.0)


def test_handles_are_plain_values_and_select_their_own_pods() -> None:
    worker = KubeDaskHandle("alice", 7, "gpulab-alice", "gpulab-dask-alice-7", 3)
    assert KubeDaskHandle.from_dict(worker.to_dict()) == worker
    assert worker.pod_selector == "dask.org/workergroup-name=gpulab-dask-alice-7-w3"
    scheduler = KubeDaskHandle("alice", 7, "gpulab-alice", "gpulab-dask-alice-7")
    assert scheduler.pod_selector == (
        "dask.org/cluster-name=gpulab-dask-alice-7,dask.org/component=scheduler"
    )
    with pytest.raises(ValueError, match="not a Kubernetes Dask handle"):
        KubeDaskHandle.from_dict({"pid": 12})


def test_the_kube_backend_implements_the_executor_contract() -> None:
    from gpulab.hub.daskservice.executor import DaskExecutor, RunsDaskClusters
    from gpulab.spawner.kube.dask import KubeDaskExecutor
    from gpulab.spawner.kube.spawner import GPUKubeSpawner

    async def no_target(owner: str) -> Any:
        raise AssertionError(owner)

    executor = GPUKubeSpawner.dask_executor(
        state_dir="/nonexistent", gpu_of=lambda uuid: None, spawner_for=no_target
    )
    assert isinstance(executor, KubeDaskExecutor)
    assert isinstance(executor, DaskExecutor)
    assert isinstance(GPUKubeSpawner, RunsDaskClusters)
