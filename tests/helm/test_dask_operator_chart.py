"""The dask-kubernetes operator the chart runs when Dask is on: its Deployment starts the real
operator through gpulab's entry point, a pre-install/pre-upgrade hook Job creates its CRDs with
gpulab's installer, and each has exactly the rights its code uses (read from the sources of the
operator and of the installer, so a new call without a rule fails here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import dask_kubernetes.operator.controller.controller as controller

import gpulab.spawner.kube.dask_operator as dask_operator
from tests.helm.conftest import find

OPERATOR = "gpulab-dask-operator"
CRDS = "gpulab-dask-operator-crds"
ENTRY = [sys.executable, "-m", "gpulab.spawner.kube.dask_operator"]


def dask_values(**operator: Any) -> dict[str, Any]:
    return {"gpulab": {"dask": {"enabled": True, "operator": operator}}}


def by_component(objects: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["labels"].get("component") == component]


def allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in rule.get("apiGroups", ())
        and resource in rule.get("resources", ())
        and verb in rule["verbs"]
        for rule in rules
    )


def test_no_operator_without_dask_or_where_the_cluster_runs_its_own(check: ModuleType) -> None:
    for values in ({}, dask_values(install=False)):
        objects = check.manifests(check.render(values))
        assert by_component(objects, "dask-operator") == []
        assert by_component(objects, "dask-crds") == []


def test_the_operator_runs_through_gpulabs_entry_point_with_the_hubs_image(
    check: ModuleType,
) -> None:
    objects = check.manifests(check.render(dask_values(install=True)))
    (deployment,) = find(by_component(objects, "dask-operator"), "Deployment", OPERATOR)
    (hub,) = find(objects, "Deployment", "gpulab-hub")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["python3", "-m", "gpulab.spawner.kube.dask_operator", "run"]
    assert container["image"] == hub["spec"]["template"]["spec"]["containers"][0]["image"]
    assert pod["serviceAccountName"] == OPERATOR
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # both commands the chart gives are actions of the entry point
    usage = subprocess.run([*ENTRY, "--help"], capture_output=True, text=True, check=True).stdout
    assert "install-crds" in usage and "run" in usage


def test_the_operators_role_allows_what_the_operator_does(check: ModuleType) -> None:
    objects = check.manifests(check.render(dask_values(install=True)))
    (role,) = find(by_component(objects, "dask-operator"), "ClusterRole", f"gpulab-{OPERATOR}")
    (binding,) = find(
        by_component(objects, "dask-operator"), "ClusterRoleBinding", f"gpulab-{OPERATOR}"
    )
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": OPERATOR, "namespace": "gpulab"}
    ]
    source = Path(controller.__file__).read_text()
    # the Dask kinds its kopf handlers watch, and the kinds it makes through kr8s
    watched = set(re.findall(r'kopf\.on\.\w+\(\s*"(\w+)\.kubernetes\.dask\.org"', source))
    assert {"daskcluster", "daskworkergroup", "daskjob", "daskautoscaler"} <= watched
    made = re.search(r"from kr8s\.asyncio\.objects import ([\w, ]+)", source)
    assert made is not None
    kinds = {
        "Deployment": ("apps", "deployments"),
        "Pod": ("", "pods"),
        "Service": ("", "services"),
    }
    missing = []
    for kind in watched:
        for verb in ("get", "list", "watch", "patch"):
            if not allowed(role["rules"], "kubernetes.dask.org", kind + "s", verb):
                missing.append(f"{verb} {kind}s")
    for name in (n.strip() for n in made.group(1).split(",")):
        group, resource = kinds[name]
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            if not allowed(role["rules"], group, resource, verb):
                missing.append(f"{verb} {group or 'core'}/{resource}")
    assert ".scale(" in source  # kr8s scales worker groups through their scale subresource
    if not allowed(role["rules"], "kubernetes.dask.org", "daskworkergroups/scale", "patch"):
        missing.append("patch daskworkergroups/scale")
    assert missing == []
    # the hub's own rights do not grow with it: no pods or Deployments in other namespaces
    (hub_role,) = find(by_component(objects, "hub"), "ClusterRole")
    assert not allowed(hub_role["rules"], "apps", "deployments", "create")
    assert not allowed(hub_role["rules"], "", "pods", "create")


def test_a_hook_job_creates_the_crds_with_gpulabs_installer_and_only_those_rights(
    check: ModuleType,
) -> None:
    objects = by_component(check.manifests(check.render(dask_values(install=True))), "dask-crds")
    (job,) = find(objects, "Job", CRDS)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["gpulab.spawner.kube.dask_operator", "install-crds"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"

    def hook(o: dict[str, Any]) -> tuple[str, int]:
        notes = o["metadata"]["annotations"]
        return notes["helm.sh/hook"], int(notes["helm.sh/hook-weight"])

    assert hook(job) == ("pre-install,pre-upgrade", 0)
    # its account, role and binding exist before it runs (lower weight), and go after it
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        # cluster-scoped names carry the release's namespace ("gpulab" here)
        (o,) = find(objects, kind, CRDS if kind == "ServiceAccount" else f"gpulab-{CRDS}")
        assert hook(o) == ("pre-install,pre-upgrade", -10)
        assert "hook-succeeded" in o["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
    (role,) = find(objects, "ClusterRole", f"gpulab-{CRDS}")
    # what install_crds calls: create, or read and replace, each CRD; and the cluster's schemas
    calls = re.findall(
        r"\.(create|read|replace)_custom_resource_definition\(",
        Path(dask_operator.__file__).read_text(),
    )
    verbs = {{"create": "create", "read": "get", "replace": "update"}[c] for c in calls}
    assert verbs == {"create", "get", "update"}
    crd_rules = [r for r in role["rules"] if "resources" in r]
    assert crd_rules == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": sorted(verbs, key=["get", "create", "update"].index),
        }
    ]
    assert [r for r in role["rules"] if "nonResourceURLs" in r] == [
        {"nonResourceURLs": ["/openapi/v2"], "verbs": ["get"]}
    ]
