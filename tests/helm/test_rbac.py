"""The hub's RBAC allows every Kubernetes API call gpulab's Kubernetes backend and KubeSpawner
make: the calls are read from their sources, so a new call without a rule fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubespawner
import pytest

from tests.helm.conftest import REPO, find

#: hub-side sources that call the Kubernetes API (dask_operator.py is the admin's CRD installer
#: and the operator's entry point, pod_security.py's call the chart's namespace-labelling hook
#: Job's: none is run by the hub)
SOURCES = [
    *sorted((REPO / "spawner" / "kube").glob("*.py")),
    *sorted((REPO / "spawner" / "workspaces").glob("kube*.py")),
]
NOT_THE_HUBS = {"dask_operator.py", "pod_security.py"}
KUBESPAWNER = Path(kubespawner.__file__).parent / "spawner.py"

CALL = re.compile(
    r"\.(create|read|list|delete|patch|replace|get)_(namespaced_)?([a-z_]+?)(_for_all_namespaces)?\b"
)
VERBS = {"create": "create", "read": "get", "get": "get", "list": "list", "delete": "delete"}
VERBS |= {"patch": "patch", "replace": "update"}
#: (API group, resource) of each kind the client's method names
KINDS = {
    "pod": ("", "pods"),
    "pod_log": ("", "pods/log"),
    "persistent_volume_claim": ("", "persistentvolumeclaims"),
    "secret": ("", "secrets"),
    "service": ("", "services"),
    "event": ("", "events"),
    "job": ("batch", "jobs"),
    "deployment": ("apps", "deployments"),
    "network_policy": ("networking.k8s.io", "networkpolicies"),
    "node": ("", "nodes"),
    "persistent_volume": ("", "persistentvolumes"),
    "priority_class": ("scheduling.k8s.io", "priorityclasses"),
}
CLUSTER_SCOPED = {"nodes", "persistentvolumes", "priorityclasses"}
#: custom objects, by the file that names them
CUSTOM = {
    "kube_volumes.py": [("snapshot.storage.k8s.io", "volumesnapshots")],
    "dask.py": [
        ("kubernetes.dask.org", "daskclusters"),
        ("kubernetes.dask.org", "daskworkergroups"),
    ],
}
#: KubeSpawner's calls its method names do not show: kinds passed to getattr(f"create_namespaced_
#: {kind}") (internal_ssl's Secret and Service), and its reflectors' list + watch of pods and events
KUBESPAWNER_DYNAMIC = [
    *((("", r), v, False) for r in ("secrets", "services") for v in ("create", "get", "delete")),
    *((("", r), v, False) for r in ("pods", "events") for v in ("list", "watch")),
]
#: gpulab's own watches (spawner/kube/state.py's WatchCache of every Node and Pod)
GPULAB_WATCHES = [(("", "nodes"), "watch", True), (("", "pods"), "watch", True)]


def needed_calls() -> set[tuple[tuple[str, str], str, bool]]:
    """((group, resource), verb, cluster-wide) of every call."""
    needed: set[tuple[tuple[str, str], str, bool]] = set()
    for path in [*SOURCES, KUBESPAWNER]:
        if path.name in NOT_THE_HUBS:
            continue
        for verb, namespaced, kind, all_namespaces in CALL.findall(path.read_text()):
            if kind == "custom_object":
                for resource in CUSTOM[path.name]:
                    needed.add((resource, VERBS[verb], False))
                continue
            if kind not in KINDS:
                assert not namespaced, f"{path.name}: map the kind of {verb}_namespaced_{kind}"
                continue  # a helper of gpulab's own (create_snapshot, get_env...)
            resource = KINDS[kind]
            cluster = bool(all_namespaces) or resource[1] in CLUSTER_SCOPED
            needed.add((resource, VERBS[verb], cluster))
    return needed | set(KUBESPAWNER_DYNAMIC) | set(GPULAB_WATCHES)


def hubs(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The hub's objects of `kind` (the Dask operator has a ClusterRole of its own)."""
    return [o for o in find(objects, kind) if o["metadata"]["labels"]["component"] == "hub"]


def allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in rules
    )


def test_the_sources_are_read() -> None:
    calls = needed_calls()
    assert (("", "pods"), "create", False) in calls  # KubeSpawner
    assert (("", "pods"), "list", True) in calls  # the allocator's view of the cluster
    assert (("batch", "jobs"), "create", False) in calls  # GPU jobs
    assert (("snapshot.storage.k8s.io", "volumesnapshots"), "create", False) in calls


@pytest.mark.parametrize("values_name", ["default", "all options"])
def test_every_call_is_allowed(
    default_objects: list[dict[str, Any]],
    all_options_objects: list[dict[str, Any]],
    values_name: str,
) -> None:
    objects = default_objects if values_name == "default" else all_options_objects
    (role,) = find(objects, "Role")
    (cluster_role,) = hubs(objects, "ClusterRole")
    dask_on = values_name != "default"
    missing = []
    for (group, resource), verb, cluster in sorted(needed_calls()):
        if not dask_on and group in ("kubernetes.dask.org", "apps"):
            continue  # only Dask clusters use them (gpulab.dask.enabled)
        if not dask_on and resource == "networkpolicies":
            continue  # the chart ships the servers' policies; Dask makes its own
        rules = cluster_role["rules"] if cluster else role["rules"] + cluster_role["rules"]
        if not allowed(rules, group, resource, verb):
            missing.append(f"{verb} {group or 'core'}/{resource}{' (cluster)' if cluster else ''}")
    assert missing == []


def test_nothing_is_allowed_that_no_call_needs(all_options_objects: list[dict[str, Any]]) -> None:
    needed = {(g, r, v) for (g, r), v, _ in needed_calls()}
    (role,) = find(all_options_objects, "Role")
    (cluster_role,) = hubs(all_options_objects, "ClusterRole")
    extra = [
        f"{verb} {group or 'core'}/{resource}"
        for rule in role["rules"] + cluster_role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if (group, resource, verb) not in needed
    ]
    assert extra == []
