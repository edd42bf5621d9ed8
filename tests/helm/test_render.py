"""The chart renders with its default values and with every option on (ci/lint-values.yaml), and
what it renders is valid for the oldest Kubernetes Chart.yaml admits (1.20), 1.31 and the dev cluster's (1.37): strict
schema validation of every object (kubernetes-validate's schemas; unknown fields are errors)."""

from __future__ import annotations

import base64
import re
from collections import Counter
from types import ModuleType
from typing import Any

import pytest

from tests.helm.conftest import REPO, find, load_tool

VERSIONS = load_tool("check").validated_versions()


def kinds(objects: list[dict[str, Any]]) -> Counter[str]:
    return Counter(o["kind"] for o in objects)


def test_the_default_values_render_the_hub_the_proxy_rbac_and_the_isolation(
    default_objects: list[dict[str, Any]],
) -> None:
    assert kinds(default_objects) == {
        "ConfigMap": 1,
        "Secret": 1,
        "PersistentVolumeClaim": 1,
        # the hub's, and the Pod Security hook Job's (singleuser.podSecurity)
        "ServiceAccount": 2,
        "ClusterRole": 2,
        "ClusterRoleBinding": 2,
        "Job": 1,
        "Role": 1,
        "RoleBinding": 1,
        "Deployment": 2,  # hub, proxy
        "Service": 3,  # hub, proxy-api, proxy-public
        "PriorityClass": 2,  # on-demand, preemptible
        "NetworkPolicy": 2,  # servers, job pods
    }


def test_every_option_renders_placeholders_and_a_snapshot_class_too(
    all_options_objects: list[dict[str, Any]],
) -> None:
    found = kinds(all_options_objects)
    # hub, proxy, a placeholder Deployment per profile, the Dask operator
    assert found["Deployment"] == 2 + 3 + 1
    assert found["PriorityClass"] == 3  # and the placeholders'
    assert found["VolumeSnapshotClass"] == 1


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values_name", ["default", "all options"])
def test_every_object_is_valid_for_the_kubernetes_version(
    check: ModuleType,
    default_objects: list[dict[str, Any]],
    all_options_objects: list[dict[str, Any]],
    values_name: str,
    version: str,
) -> None:
    objects = default_objects if values_name == "default" else all_options_objects
    errors, unvalidated = check.schema_errors(objects, version)
    assert errors == []
    assert unvalidated == []  # the VolumeSnapshotClass against its CRD's schema


@pytest.mark.parametrize("version", VERSIONS)
def test_the_validator_refuses_an_unknown_field_and_a_wrong_type(
    check: ModuleType, default_objects: list[dict[str, Any]], version: str
) -> None:
    """The validation above can fail: strict, for every version (1.20 from its own folder)."""
    import copy

    hub = copy.deepcopy(find(default_objects, "Deployment", "gpulab-hub")[0])
    hub["spec"]["template"]["spec"]["containers"][0]["commandd"] = ["jupyterhub"]
    priority = copy.deepcopy(find(default_objects, "PriorityClass")[0])
    priority["value"] = "high"
    snapshots = {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshotClass",
        "metadata": {"name": "homes"},
        "driver": "ebs.csi.aws.com",
        "deletionPolicy": "Keep",
    }
    errors, _ = check.schema_errors([hub, priority, snapshots], version)
    assert len(errors) == 3, errors
    assert "commandd" in errors[0] and "high" in errors[1] and "Keep" in errors[2]


def test_every_object_carries_z2jhs_labels(all_options_objects: list[dict[str, Any]]) -> None:
    for obj in all_options_objects:
        labels = obj["metadata"]["labels"]
        assert {"app", "component", "release", "chart", "heritage"} <= set(labels), obj["kind"]
        assert labels["app"] == "gpulab-ci"  # nameOverride


def test_the_hub_runs_gpulabs_config_from_its_configmap(
    default_objects: list[dict[str, Any]],
) -> None:
    hub = find(default_objects, "Deployment", "gpulab-hub")[0]["spec"]["template"]["spec"]
    container = hub["containers"][0]
    assert container["args"] == ["jupyterhub", "-f", "/etc/gpulab/jupyterhub_config.py"]
    assert {"name": "config", "mountPath": "/etc/gpulab", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert hub["serviceAccountName"] == "gpulab-hub"
    assert hub["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    config = find(default_objects, "ConfigMap", "gpulab-hub")[0]["data"]
    assert config["jupyterhub_config.py"].rstrip().endswith("apply(c)")


def secret_data(objects: list[dict[str, Any]]) -> dict[str, str]:
    (secret,) = find(objects, "Secret")
    data = secret["data"]
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def test_secrets_are_generated_when_not_given(default_objects: list[dict[str, Any]]) -> None:
    data = secret_data(default_objects)
    assert set(data) == {"cookie-secret", "proxy-token"}
    for value in data.values():
        assert re.fullmatch("[0-9a-f]{64}", value)
    assert data["cookie-secret"] != data["proxy-token"]


def test_given_secrets_and_the_database_url_stay_in_the_secret(
    lint_values: dict[str, Any], all_options_objects: list[dict[str, Any]]
) -> None:
    data = secret_data(all_options_objects)
    assert data["cookie-secret"] == lint_values["hub"]["cookieSecret"]
    assert data["proxy-token"] == lint_values["proxy"]["secretToken"]
    assert data["db-url"] == lint_values["hub"]["db"]["url"]
    for config in find(all_options_objects, "ConfigMap"):
        assert "secret@postgres" not in str(config["data"])


def test_the_proxy_public_service_takes_the_node_port(
    all_options_objects: list[dict[str, Any]],
) -> None:
    service = find(all_options_objects, "Service", "gpulab-ci-proxy-public")
    assert not service  # the release is named gpulab, the chart gpulab-ci: <release>-<name>
    service = find(all_options_objects, "Service", "gpulab-gpulab-ci-proxy-public")[0]
    assert service["spec"]["type"] == "NodePort"
    assert service["spec"]["ports"][0]["nodePort"] == 30080


def test_a_key_named_twice_in_a_template_is_an_error(check: ModuleType) -> None:
    """What yamllint finds in z2jh's rendered templates: YAML keeps the last of two equal keys,
    so a template that writes a field twice loses the first without a word."""
    rendered = {"t/a.yaml": "kind: Pod\nspec:\n  tolerations: []\n  tolerations: [{}]\n"}
    with pytest.raises(check.DuplicateKey, match="tolerations"):
        check.manifests(rendered)


def test_no_container_of_gpulabs_images_replaces_their_entrypoint(
    check: ModuleType, all_options_objects: list[dict[str, Any]]
) -> None:
    """The hub image's ENTRYPOINT is tini (reaping the hub's and the operator's children,
    passing on SIGTERM); a container `command` would replace it, so gpulab's containers give
    `args` only."""
    dockerfile = (REPO / "images" / "hub" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tini", "--"]' in dockerfile
    hub_image = check.lint_values()["hub"]["image"]["name"]
    pods = [
        o["spec"]["template"]["spec"]
        for o in all_options_objects
        if o["kind"] in ("Deployment", "Job")
    ]
    mine = [c for pod in pods for c in pod["containers"] if c["image"].startswith(hub_image)]
    # the hub, the Dask operator, the Dask CRDs' hook Job, the Pod Security hook Job
    assert len(mine) == 4
    assert [c["name"] for c in mine if "command" in c] == []
    assert all(c["args"] for c in mine)
