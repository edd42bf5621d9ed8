"""A warm pool member's placeholder pod (objects.warm_member_pod_manifest), compared whole, and
the cluster view rebuilt from it: the member's reservation under its own id, never twice."""

from __future__ import annotations

import json
from fractions import Fraction

from gpulab.hub.allocator import GpuShare, Placement, Request
from gpulab.hub.profiles import Profile
from gpulab.hub.warmpool import WARM_POOL_OWNER, member_allocation_id
from gpulab.spawner.kube.gpu_resources import placed_pod
from gpulab.spawner.kube.objects import warm_member_pod_manifest
from gpulab.spawner.kube.warm_pool import member_pod_name
from gpulab.spawner.names import PLACEMENT_ANNOTATION
from tests.spawner.kube.test_placeholder_pods import held, state_with

PROFILE = Profile("a100-1", "1 A100", gpu=Fraction(1), gpu_models=frozenset({"A100-SXM4-80GB"}))
MEMBER_ID = member_allocation_id("a100-1", 3)


def member_placement(uuid: str = "n1/gpu-1") -> Placement:
    request = Request(
        id=MEMBER_ID,
        owner=WARM_POOL_OWNER,
        num_gpu=1,
        gpu_models=frozenset({"A100-SXM4-80GB"}),
        priority="preemptible",
        profile="a100-1",
        workload="warm",
    )
    return Placement(request=request, node="n1", gpus=(GpuShare(uuid, 1000),), created_at=100.0)


def member_manifest(placement: Placement) -> dict:
    spec = placed_pod(
        PROFILE,
        placement,
        sharing="mig",
        priority="preemptible",
        device=None,
        gpu_memory_mib=81920,
    ).gpu
    return warm_member_pod_manifest(
        "gpulab-warm-a100-1-3-abcdef",
        namespace="lab",
        placement=placement,
        limits=spec.limits,
        node_affinity_required=spec.node_affinity_required,
        tolerations=spec.tolerations,
        priority_class_name=spec.priority_class_name,
        image="gpulab/singleuser:1.2",
    )


def test_member_pod_holds_the_reservation_with_a_servers_scheduling_and_nothing_of_a_tenant():
    placement = member_placement()
    manifest = member_manifest(placement)
    hardening = {
        "runAsUser": 65535,
        "runAsGroup": 65535,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    annotation = manifest["metadata"]["annotations"].pop(PLACEMENT_ANNOTATION)
    assert json.loads(annotation)["request"]["id"] == MEMBER_ID
    assert json.loads(annotation)["request"]["owner"] == WARM_POOL_OWNER
    assert json.loads(annotation)["gpus"] == [["n1/gpu-1", 1000]]
    assert manifest == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "gpulab-warm-a100-1-3-abcdef",
            "namespace": "lab",
            "labels": {"gpulab.io/warm-member": "true"},
            "annotations": {},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            # pulls the server image onto the node before the member counts as Running
            "initContainers": [
                {
                    "name": "pull",
                    "image": "gpulab/singleuser:1.2",
                    "command": ["true"],
                    "securityContext": hardening,
                }
            ],
            "containers": [
                {
                    "name": "hold",
                    "image": "registry.k8s.io/pause:3.9",
                    "resources": {
                        "limits": {"nvidia.com/gpu": "1"},
                        "requests": {"nvidia.com/gpu": "1"},
                    },
                    "securityContext": hardening,
                }
            ],
            # preemptible: tolerates spot nodes, as a preemptible server would
            "tolerations": [
                {"key": "gpulab.io/spot", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "nvidia.com/gpu.product",
                                        "operator": "In",
                                        "values": ["NVIDIA-A100-SXM4-80GB"],
                                    },
                                    {
                                        "key": "kubernetes.io/hostname",
                                        "operator": "In",
                                        "values": ["n1"],
                                    },
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "gpulab-preemptible",
        },
    }
    assert "volumes" not in manifest["spec"]
    assert all("env" not in c for c in manifest["spec"]["containers"])


def test_member_pod_names_are_dns_names_unique_per_start():
    first, second = member_pod_name(MEMBER_ID), member_pod_name(MEMBER_ID)
    assert first.startswith("gpulab-warm-a100-1-3-") and first != second
    assert len(first) <= 63 and first == first.lower()


def _live(manifest: dict, node: str = "n1") -> dict:
    manifest["spec"]["nodeName"] = node
    manifest["status"] = {"phase": "Running"}
    return manifest


def test_a_restarted_hub_counts_a_member_pod_as_the_members_reservation_once():
    placement = member_placement()
    uuid = placement.gpus[0].uuid
    state = state_with([_live(member_manifest(placement))])
    assert held(state) == [MEMBER_ID]  # under its id: GPUWarmPool.sweep / keep_allocations see it
    assert [s.uuid for s in state.allocator.get(MEMBER_ID).gpus] == [uuid]


def test_a_handed_over_share_is_hers_and_the_deleted_member_pod_releases_nothing_of_it():
    placement = member_placement()
    member_pod = _live(member_manifest(placement))
    state = state_with([member_pod])
    real_uuid = state.allocator.get(MEMBER_ID).gpus[0].uuid
    hers = Request(
        id="kim/",
        owner="kim",
        num_gpu=1,
        gpu_models=frozenset({"A100-SXM4-80GB"}),
        profile="a100-1",
    )
    handed = state.allocator.hand_over(MEMBER_ID, hers)
    assert handed.gpus[0].uuid == real_uuid and held(state) == ["kim/"]
    state._rebuild()  # a node change while the member pod is still there: not counted twice
    assert held(state) == ["kim/"]
    state.pods.objects.pop("lab/gpulab-warm-a100-1-3-abcdef")
    state._pod_changed("DELETED", member_pod)
    assert held(state) == ["kim/"]  # the member pod's end is not hers
    state._rebuild()  # her pod not created yet: her allocation stays reserved
    assert held(state) == ["kim/"]


def test_the_backend_reads_the_spawners_settings_and_an_image_change_makes_members_stale():
    import logging

    from traitlets.config import Config

    from gpulab.spawner.kube.spawner import GPUKubeSpawner

    def backend(config: dict):
        return GPUKubeSpawner.warm_pool_backend(config=Config(config), log=logging.getLogger())

    plain = backend({"KubeSpawner": {"namespace": "lab", "image": "lab:1"}})
    assert (plain.namespace, plain.image, plain.sharing) == ("lab", "lab:1", "mig")
    assert plain.priority_classes["preemptible"] == ("gpulab-preemptible", 100)
    # the subclass's section over its parent's, as traitlets resolves a spawner's config
    ours = backend(
        {
            "KubeSpawner": {"namespace": "lab", "image": "lab:1"},
            "GPUKubeSpawner": {"image": "lab:2", "gpu_sharing": "hami"},
        }
    )
    assert (ours.namespace, ours.image, ours.sharing) == ("lab", "lab:2", "hami")
    assert plain.fingerprint(PROFILE) != ours.fingerprint(PROFILE)
    assert plain.fingerprint(PROFILE) == backend(
        {"KubeSpawner": {"namespace": "lab", "image": "lab:1"}}
    ).fingerprint(PROFILE)
