"""What Kueue and JobSet get in the dev cluster (devcluster/batch_manifests.py), its pure parts: the
Configuration files, and the kustomize patches and loopback `clientConfig`s made from a module's
own files (a small module tree written here, in the shape of Kueue's and JobSet's `config/`).
The controllers run in test_kueue.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpulab.devcluster import batch_manifests
from gpulab.devcluster.batch import probe_jobset

URL = "https://127.0.0.1:9443"


def test_kueues_configuration_keeps_everything_on_loopback_with_the_jobset_integration() -> None:
    cfg = batch_manifests.kueue_config(
        webhook_port=1, cert_dir=Path("/c"), metrics_port=2, health_port=3
    )
    assert cfg["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
    assert cfg["webhook"] == {"host": "127.0.0.1", "port": 1, "certDir": "/c"}
    assert cfg["metrics"] == {"bindAddress": "127.0.0.1:2"}
    assert cfg["health"] == {"healthProbeBindAddress": "127.0.0.1:3"}
    assert cfg["leaderElection"] == {"leaderElect": False}
    assert cfg["internalCertManagement"] == {"enable": False}
    assert cfg["integrations"] == {"frameworks": ["jobset.x-k8s.io/jobset"]}


def test_jobsets_configuration_serves_metrics_with_the_loopback_certificate() -> None:
    cfg = batch_manifests.jobset_config(
        webhook_port=1, cert_dir=Path("/c"), metrics_port=2, health_port=3
    )
    assert cfg["kind"] == "Configuration"
    assert cfg["metrics"] == {"bindAddress": "127.0.0.1:2", "certDir": "/c"}
    assert cfg["leaderElection"] == {"leaderElect": False}


def hook(name: str, path: str, group: str, resource: str) -> dict:
    return {
        "admissionReviewVersions": ["v1"],
        "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
        "failurePolicy": "Fail",
        "name": name,
        "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": [resource]}],
        "sideEffects": "None",
    }  # fmt: skip


@pytest.fixture
def module(tmp_path: Path) -> Path:
    """A module tree shaped like Kueue's (merge patch) and JobSet's (JSON patch) together."""
    webhook = tmp_path / "config/components/webhook"
    (webhook / "patches").mkdir(parents=True)
    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "mutating-webhook-configuration"},
        "webhooks": [
            hook("mjobset.kb.io", "/mutate-jobset", "jobset.x-k8s.io", "jobsets"),
            hook("mpod.kb.io", "/mutate--v1-pod", "", "pods"),
        ],
    }
    validating = {
        **mutating,
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "validating-webhook-configuration"},
        "webhooks": [hook("vpod.kb.io", "/validate--v1-pod", "", "pods")],
    }
    (webhook / "manifests.yaml").write_text(yaml.safe_dump_all([mutating, validating]))
    selector = {"matchExpressions": [{"key": "jobset-name", "operator": "Exists"}]}
    ops = [{"op": "add", "path": "/webhooks/1/objectSelector", "value": selector}]
    (webhook / "patches/mutating-patch.yaml").write_text(yaml.safe_dump(ops))
    merge = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "validating-webhook-configuration"},
        "webhooks": [{"name": "vpod.kb.io", "namespaceSelector": {"matchLabels": {"a": "b"}}}],
    }
    kustomization = {
        "resources": ["manifests.yaml"],
        "patches": [
            {
                "path": "patches/mutating-patch.yaml",
                "target": {"kind": "MutatingWebhookConfiguration", "name": "mutating-webhook-configuration"},
            },
            {"patch": yaml.safe_dump(merge)},
        ],
    }  # fmt: skip
    (webhook / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    (tmp_path / "config/default").mkdir(parents=True)
    (tmp_path / "config/default/kustomization.yaml").write_text("namePrefix: kueue-\n")
    crd = tmp_path / "config/components/crd"
    (crd / "bases").mkdir(parents=True)
    (crd / "patches").mkdir()
    for plural in ("workloads", "topologies"):
        doc = {"kind": "CustomResourceDefinition", "metadata": {"name": f"{plural}.kueue.x-k8s.io"}, "spec": {}}  # fmt: skip
        (crd / f"bases/kueue.x-k8s.io_{plural}.yaml").write_text(yaml.safe_dump(doc))
        (crd / f"patches/webhook_in_{plural}.yaml").write_text(yaml.safe_dump(doc))
    (crd / "kustomization.yaml").write_text(
        "patches:\n- path: patches/webhook_in_workloads.yaml\n#- path: patches/webhook_in_topologies.yaml\n"
    )
    return tmp_path


def test_webhooks_call_the_loopback_url_with_the_ca_and_keep_the_kustomize_patches(
    module: Path,
) -> None:
    mutating, validating = batch_manifests.webhook_configurations(module, URL, "Q0E=")
    assert mutating["metadata"] == {"name": "kueue-mutating-webhook-configuration"}
    assert [w["clientConfig"] for w in mutating["webhooks"]] == [
        {"url": f"{URL}/mutate-jobset", "caBundle": "Q0E="},
        {"url": f"{URL}/mutate--v1-pod", "caBundle": "Q0E="},
    ]
    assert mutating["webhooks"][1]["objectSelector"]["matchExpressions"][0]["key"] == "jobset-name"
    assert validating["webhooks"][0]["namespaceSelector"] == {"matchLabels": {"a": "b"}}
    assert validating["webhooks"][0]["failurePolicy"] == "Fail"


def test_only_the_webhooks_of_the_given_api_groups_are_registered(module: Path) -> None:
    (only,) = batch_manifests.webhook_configurations(module, URL, "Q0E=", {"jobset.x-k8s.io"})
    assert [w["name"] for w in only["webhooks"]] == ["mjobset.kb.io"]


def test_crds_the_kustomization_converts_convert_through_the_controller(module: Path) -> None:
    assert batch_manifests.conversion_crd_names(module) == {"workloads.kueue.x-k8s.io"}
    names = [c["metadata"]["name"] for c in batch_manifests.crds(module)]
    assert names == ["topologies.kueue.x-k8s.io", "workloads.kueue.x-k8s.io"]
    crd = batch_manifests.with_conversion_webhook({"spec": {"group": "g"}}, URL, "Q0E=")
    assert crd["spec"]["conversion"]["webhook"]["clientConfig"] == {
        "url": f"{URL}/convert",
        "caBundle": "Q0E=",
    }
    assert crd["spec"]["group"] == "g"


def test_json_patch_adds_replaces_and_removes_on_a_copy() -> None:
    doc = {"a": [1, 2], "b": {"c": 1}}
    out = batch_manifests.json_patch(
        doc,
        [
            {"op": "replace", "path": "/a/1", "value": 3},
            {"op": "add", "path": "/a/-", "value": 4},
            {"op": "add", "path": "/b/d~1e", "value": 5},
            {"op": "remove", "path": "/b/c"},
        ],
    )
    assert out == {"a": [1, 3, 4], "b": {"d/e": 5}}
    assert doc == {"a": [1, 2], "b": {"c": 1}}
    with pytest.raises(ValueError, match="move"):
        batch_manifests.json_patch(doc, [{"op": "move", "path": "/a", "from": "/b"}])


def test_the_webhook_probe_is_a_queued_jobset_that_asks_for_no_suspension() -> None:
    probe = probe_jobset("q")
    assert probe["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "q"}
    assert "suspend" not in probe["spec"]
