"""What Kueue and JobSet need in the dev cluster, made from their Go modules' own files (pure).

Each module ships its install as kustomize input under `config/`: CRDs in
`config/components/crd/bases`, the webhooks in `config/components/webhook/manifests.yaml` (with a
Service as `clientConfig`), and kustomizations that patch them: a conversion webhook per CRD
(`crd/kustomization.yaml` lists `patches/webhook_in_<plural>.yaml`), object or namespace
selectors for the pod webhooks (`webhook/kustomization.yaml`: JSON patches by target, or merge
patches by webhook name), and a `namePrefix` (`config/default/kustomization.yaml`). No kustomize
binary is at hand, so the few patches these use are applied here, and every Service reference
becomes `clientConfig.url: https://127.0.0.1:PORT/<path>` with the CA that signed the
controller's loopback certificate (`pki.LoopbackPKI`): the controllers run on this machine, out
of the cluster, beside the API server.

And each controller's Configuration file: leader election off, metrics, health and webhooks on
loopback, certificates from the given folder.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

LOOPBACK = "127.0.0.1"
#: Kueue's integration for JobSet, as its Configuration names it
JOBSET_FRAMEWORK = "jobset.x-k8s.io/jobset"


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def crds(module_dir: Path) -> list[dict[str, Any]]:
    """The module's CRDs, in file-name order."""
    folder = module_dir / "config" / "components" / "crd" / "bases"
    found = [d for p in sorted(folder.glob("*.yaml")) for d in load_docs(p)]
    if not found:
        raise FileNotFoundError(f"no CRDs in {folder}")
    return found


def patch_paths(kustomization: str, prefix: str) -> list[str]:
    """The uncommented `- path: <prefix>...` entries of a kustomization (pure)."""
    return re.findall(rf"^\s*-\s+path:\s*({re.escape(prefix)}\S*)\s*$", kustomization, re.M)


def conversion_crd_names(module_dir: Path) -> set[str]:
    """The CRDs the module's kustomization gives a conversion webhook."""
    folder = module_dir / "config" / "components" / "crd"
    paths = patch_paths((folder / "kustomization.yaml").read_text(), "patches/webhook_in_")
    return {load_docs(folder / p)[0]["metadata"]["name"] for p in paths}


def with_conversion_webhook(crd: dict[str, Any], url: str, ca_bundle: str) -> dict[str, Any]:
    """The CRD converting through `url` (its `/convert`) instead of a Service."""
    out = copy.deepcopy(crd)
    out["spec"]["conversion"] = {
        "strategy": "Webhook",
        "webhook": {
            "clientConfig": {"url": f"{url}/convert", "caBundle": ca_bundle},
            "conversionReviewVersions": ["v1"],
        },
    }
    return out


def json_patch(doc: dict[str, Any], ops: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `add`, `replace` and `remove` (all these kustomizations use), on a copy."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
        if op["op"] == "remove":
            del node[key]
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(key, op["value"])
        elif op["op"] in ("add", "replace"):
            node[key] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"JSON patch op {op['op']!r} is not supported here")
    return out


def _patched_webhooks(module_dir: Path, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    folder = module_dir / "config" / "components" / "webhook"
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for entry in kustomization.get("patches") or []:
        if "path" in entry:  # JSON patch ops, applied to the target it names
            target = entry.get("target") or {}
            ops = yaml.safe_load((folder / entry["path"]).read_text())
            docs = [
                json_patch(d, ops)
                if d["kind"] == target.get("kind") and d["metadata"]["name"] == target.get("name")
                else d
                for d in docs
            ]
        elif "patch" in entry:  # a merge patch: webhooks merged by name
            patch = yaml.safe_load(entry["patch"])
            for d in docs:
                if (d["kind"], d["metadata"]["name"]) != (patch["kind"], patch["metadata"]["name"]):
                    continue
                changes = {w["name"]: w for w in patch.get("webhooks") or []}
                for w in d.get("webhooks") or []:
                    w.update(copy.deepcopy(changes.get(w["name"], {})))
    return docs


def name_prefix(module_dir: Path) -> str:
    """`namePrefix` of the module's default kustomization (`kueue-`, `jobset-`)."""
    default = module_dir / "config" / "default" / "kustomization.yaml"
    return str(yaml.safe_load(default.read_text()).get("namePrefix") or "")


def webhook_configurations(
    module_dir: Path, url: str, ca_bundle: str, groups: set[str] | None = None
) -> list[dict[str, Any]]:
    """The module's Mutating/ValidatingWebhookConfigurations, patched as its kustomization
    patches them, named with its prefix, calling `url` + each webhook's path. With `groups`:
    only the webhooks whose rules are all about those API groups (Kueue ships webhooks for
    every integration, Pods and Deployments among them; the ones for integrations left off are
    not registered, so nothing else in the cluster waits on this controller)."""
    path = module_dir / "config" / "components" / "webhook" / "manifests.yaml"
    docs = _patched_webhooks(module_dir, load_docs(path))
    prefix = name_prefix(module_dir)
    out = []
    for doc in docs:
        hooks = []
        for hook in doc.get("webhooks") or []:
            rule_groups = {g for r in hook.get("rules") or [] for g in r.get("apiGroups") or []}
            if groups is not None and not rule_groups <= groups:
                continue
            service = hook["clientConfig"]["service"]
            hooks.append(
                {**hook, "clientConfig": {"url": url + service["path"], "caBundle": ca_bundle}}
            )
        if hooks:
            meta = {"name": prefix + doc["metadata"]["name"]}
            out.append({**doc, "metadata": meta, "webhooks": hooks})
    return out


def kueue_config(
    *,
    webhook_port: int,
    cert_dir: Path,
    metrics_port: int,
    health_port: int,
    namespace: str = "kueue-system",
    frameworks: tuple[str, ...] = (JOBSET_FRAMEWORK,),
) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a controller beside the dev
    cluster. `internalCertManagement` off: its own rotator would sign for the in-cluster Service
    name, which the API server cannot check against https://127.0.0.1. The visibility server
    (an aggregated API server needing an APIService and certificates at `/visibility`) is off."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": namespace,
        "health": {"healthProbeBindAddress": f"{LOOPBACK}:{health_port}"},
        "metrics": {"bindAddress": f"{LOOPBACK}:{metrics_port}"},
        "webhook": {"host": LOOPBACK, "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": list(frameworks)},
        "featureGates": {"VisibilityOnDemand": False},
    }


def jobset_config(
    *, webhook_port: int, cert_dir: Path, metrics_port: int, health_port: int
) -> dict[str, Any]:
    """JobSet's Configuration (config.jobset.x-k8s.io/v1alpha1), likewise; its metrics server
    serves with the same loopback certificate."""
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"{LOOPBACK}:{health_port}"},
        "metrics": {"bindAddress": f"{LOOPBACK}:{metrics_port}", "certDir": str(cert_dir)},
        "webhook": {"host": LOOPBACK, "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
    }
