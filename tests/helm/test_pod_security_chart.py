"""Pod Security admission on the release's namespace (singleuser.podSecurity): a pre-install and
pre-upgrade hook Job labels it through gpulab's own command (the labels its code builds), with
the right to get and patch that one Namespace only; `""` leaves the namespace alone; the chart's
own pods pass `restricted`; and settings every server would be refused for are refused."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from helm_python import HelmError

from gpulab.spawner.kube.pod_security import namespace_label_patch, parse_arguments
from tests.harness.pod_security import restricted_violations
from tests.helm.conftest import find

HOOK = "gpulab-pod-security"


def by_component(objects: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["labels"].get("component") == component]


def pod_security(**values: Any) -> dict[str, Any]:
    return {"singleuser": {"podSecurity": values}}


def hook(o: dict[str, Any]) -> tuple[str, int]:
    notes = o["metadata"]["annotations"]
    return notes["helm.sh/hook"], int(notes["helm.sh/hook-weight"])


def test_a_hook_job_labels_the_namespace_restricted_by_default_with_gpulabs_command(
    default_objects: list[dict[str, Any]],
) -> None:
    objects = by_component(default_objects, "pod-security")
    (job,) = find(objects, "Job", HOOK)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:3] == ["python3", "-m", "gpulab.spawner.kube.pod_security"]
    # what the command does with those arguments: the labels gpulab's code builds
    namespace, patch = parse_arguments(container["args"][3:])
    assert namespace == "gpulab"  # the release's namespace (check.render's)
    assert patch == namespace_label_patch("restricted", "latest")
    assert patch["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == HOOK
    assert hook(job) == ("pre-install,pre-upgrade", -5)
    # its account, role and binding exist before it runs (lower weight), and go after it
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        (o,) = find(objects, kind, HOOK if kind == "ServiceAccount" else f"gpulab-{HOOK}")
        assert hook(o) == ("pre-install,pre-upgrade", -10)
        assert "hook-succeeded" in o["metadata"]["annotations"]["helm.sh/hook-delete-policy"]


def test_the_hooks_account_may_get_and_patch_its_own_namespace_and_nothing_else(
    default_objects: list[dict[str, Any]],
) -> None:
    (role,) = find(by_component(default_objects, "pod-security"), "ClusterRole")
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["namespaces"],
            "resourceNames": ["gpulab"],
            "verbs": ["get", "patch"],
        }
    ]
    (binding,) = find(by_component(default_objects, "pod-security"), "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": HOOK, "namespace": "gpulab"}]


def test_a_level_and_version_reach_the_command(check: ModuleType) -> None:
    objects = check.manifests(check.render(pod_security(enforce="baseline", version="v1.37")))
    (job,) = find(objects, "Job", HOOK)
    _, patch = parse_arguments(job["spec"]["template"]["spec"]["containers"][0]["args"][3:])
    assert patch == namespace_label_patch("baseline", "v1.37")


def test_an_empty_level_leaves_the_namespace_alone(check: ModuleType) -> None:
    objects = check.manifests(check.render(pod_security(enforce="")))
    assert by_component(objects, "pod-security") == []


@pytest.mark.parametrize("values_name", ["default", "all options"])
def test_every_pod_the_chart_makes_passes_restricted(
    default_objects: list[dict[str, Any]],
    all_options_objects: list[dict[str, Any]],
    values_name: str,
) -> None:
    """The chart's own pods share the namespace: the hub, the proxy, the placeholders, the Dask
    operator and both hook Jobs pass the level the namespace enforces (the dev-cluster test of
    tests/helm/test_install.py asks the API server the same)."""
    objects = default_objects if values_name == "default" else all_options_objects
    templates = {
        f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in ("Deployment", "Job")
    }
    assert len(templates) >= 3
    assert {name: restricted_violations(spec) for name, spec in templates.items()} == {
        name: [] for name in templates
    }


# -- settings every server would be refused for ----------------------------------------------


def refusal(check: ModuleType, values: dict[str, Any]) -> str:
    with pytest.raises(HelmError) as caught:
        check.render(values)
    return str(caught.value)


def test_run_as_root_is_refused_where_the_namespace_is_restricted_and_kept_elsewhere(
    check: ModuleType,
) -> None:
    values: dict[str, Any] = {"singleuser": {"runAsNonRoot": False}}
    message = refusal(check, values)
    assert "singleuser.runAsNonRoot" in message and "podSecurity.enforce: restricted" in message
    values["singleuser"]["podSecurity"] = {"enforce": "baseline"}
    traits = find(check.manifests(check.render(values)), "ConfigMap")[0]["data"]
    assert "run_as_non_root: false" in traits["gpulab-traits.yaml"]


@pytest.mark.parametrize("level", ["restricted", "baseline"])
def test_an_unconfined_seccomp_profile_is_refused_where_the_namespace_refuses_it(
    check: ModuleType, level: str
) -> None:
    values = {"singleuser": {"seccompProfile": "Unconfined", "podSecurity": {"enforce": level}}}
    message = refusal(check, values)
    assert "singleuser.seccompProfile" in message and f"enforce: {level}" in message
    values["singleuser"]["podSecurity"] = {"enforce": "privileged"}
    check.render(values)
