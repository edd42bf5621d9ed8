"""Fill one sharing backend's devices through GPUKubeSpawner and count what went wrong: the
e2e tests (tests/spawner/kube/test_fill.py) and `python -m bench.kube_fill` run the same code.

A backend over-admits when the hub accepts a spawn that no device can hold: the pod is created
and stays Pending. Here the spawns the hub accepts must all become ready, the others must be
refused with a 409 before any pod exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from traitlets.config import Config

from gpulab.devcluster import DevCluster
from tests.harness.hub import Hub, merged
from tests.harness.kube import KUBE_HUB_OVERLAY, kube_hub_overlay, placed_pods

#: (gpu_sharing, profile, the node with that backend's devices, how many shares its devices hold)
BACKENDS: list[tuple[str, str, str, int]] = [
    ("mig", "a100-quarter", "gk-a100-mig", 3),  # three 2g.20gb instances (the 1g.10gb is too small)
    ("time-slicing", "a100-eighth", "gk-a100-ts", 4),  # one GPU, four replicas
    ("hami", "l40s-eighth", "gk-l40s-hami", 4),  # one GPU, four HAMi splits (1/8 -> 1/4)
]


def backend_overlay(sharing: str, cluster: DevCluster) -> Config:
    return kube_hub_overlay(
        cluster, merged(KUBE_HUB_OVERLAY, Config({"GPUKubeSpawner": {"gpu_sharing": sharing}}))
    )


@dataclass
class FillResult:
    sharing: str
    profile: str
    slots: int
    asked: int
    started: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # user -> the hub's message
    other: dict[str, str] = field(default_factory=dict)  # user -> unexpected status and text
    pending_pods: list[str] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)
    refused_with_pod: list[str] = field(default_factory=list)

    @property
    def overadmitted(self) -> int:
        """Spawns accepted beyond what the devices hold."""
        return max(0, len(self.started) - self.slots)


def fill(hub: Hub, cluster: DevCluster, sharing: str, profile: str, slots: int, extra: int = 2):
    """Ask for slots + extra servers of `profile`, one after another, each accepted one ready
    before the next spawn (the dev cluster's volume provisioner is the bottleneck when many homes
    are made at once, and this is about admission, not speed)."""
    result = FillResult(sharing, profile, slots, slots + extra)
    users = [f"{sharing.replace('-', '')[:4]}{i}" for i in range(slots + extra)]
    for user in users:
        hub.create_user(user)
        r = hub.spawn(user, profile=profile)
        if r.status_code in (201, 202):
            try:
                hub.wait_ready(user, timeout=120)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{pod_story(cluster, user)}") from None
            result.started.append(user)
        elif r.status_code == 409:
            result.refused[user] = r.json().get("message", "")
        else:
            result.other[user] = f"{r.status_code} {r.text[:300]}"
    pods: list[dict[str, Any]] = placed_pods(cluster)
    for pod in pods:
        owner = (pod["metadata"].get("annotations") or {}).get("hub.jupyter.org/username", "")
        if owner not in users:
            continue
        if (pod.get("status") or {}).get("phase") == "Pending":
            result.pending_pods.append(pod["metadata"]["name"])
        result.nodes.add(pod["spec"].get("nodeName") or "<unbound>")
        if owner in result.refused:
            result.refused_with_pod.append(owner)
    return result


def pod_story(cluster: DevCluster, user: str) -> str:
    """What the cluster says of a user's pod: phase, conditions, container states, events."""
    lines = []
    for pod in cluster.api("GET", "/api/v1/namespaces/default/pods")["items"]:
        if (pod["metadata"].get("annotations") or {}).get("hub.jupyter.org/username") != user:
            continue
        status = pod.get("status") or {}
        lines.append(
            f"pod {pod['metadata']['name']}: {status.get('phase')} on {pod['spec'].get('nodeName')}"
        )
        lines += [
            f"  {c.get('type')}={c.get('status')} {c.get('message', '')}"
            for c in status.get("conditions") or []
        ]
        lines += [f"  container {c.get('state')}" for c in status.get("containerStatuses") or []]
    for event in cluster.api("GET", "/api/v1/namespaces/default/events")["items"]:
        if user in event["involvedObject"]["name"]:
            lines.append(f"  event {event['reason']}: {event.get('message', '')[:300]}")
    return "\n".join(lines) or f"no pod of {user}"
