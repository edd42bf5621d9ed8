"""Pod Security admission on the namespace of users' pods: its labels, and every container of a
server's pod hardened as the server's own, so that `pod-security.kubernetes.io/enforce:
restricted` (latest) admits every pod gpulab makes there.

What gpulab makes in a user namespace, and why each passes `restricted`:

- a server's pod (KubeSpawner's make_pod with `isolation.KubeIsolationMixin`'s contexts): runAsNonRoot
  and the seccomp profile at the pod, and at the server container runAsUser/runAsGroup, no
  privilege escalation, capabilities drop ALL. The containers an admin adds
  (`init_containers`, native sidecars among them, and `extra_containers`) get the server
  container's hardening under their own `securityContext` (`harden_security_context`), since
  the two settings that matter most to `restricted`, allowPrivilegeEscalation and capabilities,
  exist only per container;
- a job's pod (`job_objects`), a Dask scheduler's and worker's (`dask_objects`, made into pods by
  the dask-kubernetes operator unchanged) and a warm pool member's (`objects.warm_member_pod_manifest`,
  its image-pulling init container included): the same contexts, built by the same functions;
- volumes: the home PVC, Secrets, a projected token where an admin turns it on; no hostPath.

What `restricted` refuses, and gpulab's options keep working only where the namespace is not
restricted: `GPUKubeSpawner.run_as_non_root = False` (with uid 0 or an image that runs as
root), `seccomp_profile = "Unconfined"`, `drop_capabilities` without ALL, an admin container
whose own securityContext says otherwise, `privileged`, hostPath `volumes`, host namespaces or
ports through `extra_pod_config`, and ephemeral containers an admin adds with `kubectl debug`
(give it `--profile=restricted`).

The chart labels its namespace (`singleuser.podSecurity`) with a hook Job that runs
`python -m gpulab.spawner.kube.pod_security label-namespace <namespace> --level restricted`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

#: Pod Security admission's label prefix, and its levels (Kubernetes' own spelling)
LABEL_PREFIX = "pod-security.kubernetes.io"
LEVELS = ("privileged", "baseline", "restricted")
#: the modes gpulab sets: `enforce` refuses pods, `warn` tells whoever applies a workload (a
#: Deployment, a Job) whose pod template the level would refuse
MODES = ("enforce", "warn")


def pod_security_labels(level: str, version: str = "latest") -> dict[str, str]:
    """The namespace labels that make Pod Security admission enforce `level` (and warn about
    it) at `version` (`latest`, or a Kubernetes minor version such as `v1.37`); ValueError for
    a level Kubernetes does not know."""
    if level not in LEVELS:
        raise ValueError(f"Pod Security level {level[:40]!r}: use one of {', '.join(LEVELS)}")
    if version != "latest" and not (version.startswith("v1.") and version[3:].isdigit()):
        raise ValueError(f"Pod Security version {version[:40]!r}: use latest or v1.<minor>")
    labels: dict[str, str] = {}
    for mode in MODES:
        labels[f"{LABEL_PREFIX}/{mode}"] = level
        labels[f"{LABEL_PREFIX}/{mode}-version"] = version
    return labels


def namespace_label_patch(level: str, version: str = "latest") -> dict[str, Any]:
    """The merge patch of a Namespace that sets `pod_security_labels` (its other labels stay)."""
    return {"metadata": {"labels": pod_security_labels(level, version)}}


#: settings of the server container that are never spread to the containers an admin adds
NOT_SPREAD = ("privileged",)


def harden_security_context(
    own: Mapping[str, Any] | None, hardening: Mapping[str, Any]
) -> dict[str, Any]:
    """The securityContext of a container an admin added to a server's pod: its `own` settings,
    and for each it leaves unset the server container's (`hardening`; never `privileged`).

    What it sets itself always wins, and no default contradicts it: no runAsNonRoot for a
    container that asks for uid 0, no allowPrivilegeEscalation=false beside privileged or
    CAP_SYS_ADMIN (the API server refuses both pairs), no capabilities beside its own."""
    out = copy.deepcopy(dict(own or {}))
    defaults = {k: copy.deepcopy(v) for k, v in hardening.items() if k not in NOT_SPREAD}
    if out.get("runAsUser") == 0:
        defaults.pop("runAsNonRoot", None)
    added = ((out.get("capabilities") or {}).get("add")) or []
    if out.get("privileged") or {"SYS_ADMIN", "CAP_SYS_ADMIN"} & set(added):
        defaults.pop("allowPrivilegeEscalation", None)
    for key, value in defaults.items():
        out.setdefault(key, value)
    return out


def pod_security_refusal(status: int, body: str | bytes | None) -> str | None:
    """The API server's message when it refused a pod for Pod Security (403, "... violates
    PodSecurity ..."), else None: what a spawn that failed so tells the user and the admin."""
    if status != 403 or not body:
        return None
    try:
        message = str(json.loads(body).get("message") or "")
    except (ValueError, AttributeError):
        return None
    return message if "violates PodSecurity" in message else None


def pod_security_advice(refusal: str, namespace: str) -> str:
    """What a user and the admin are told of a pod Pod Security refused (a server's, a job's):
    the API server's message and the settings that decide what the pod asks for."""
    return (
        f"{refusal[:600]} (namespace {namespace} enforces Pod Security: see "
        "GPUKubeSpawner.run_as_non_root, seccomp_profile, drop_capabilities and "
        "the containers the config adds)"
    )


# -- the chart's hook: label the release's namespace ------------------------------------------


def parse_arguments(argv: Sequence[str] | None = None) -> tuple[str, dict[str, Any]]:
    """The command line's namespace and the patch it applies (exit 2 with a usage message for
    a bad level or version, before any cluster is called)."""
    parser = argparse.ArgumentParser(
        prog="python -m gpulab.spawner.kube.pod_security",
        description="Label a namespace for Pod Security admission (enforce and warn at one "
        "level), in the cluster of KUBECONFIG or the pod's service account.",
    )
    parser.add_argument("action", choices=["label-namespace"])
    parser.add_argument("namespace")
    parser.add_argument("--level", choices=LEVELS, default="restricted")
    parser.add_argument("--version", default="latest")
    args = parser.parse_args(argv)
    try:
        return str(args.namespace), namespace_label_patch(args.level, args.version)
    except ValueError as e:
        parser.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    namespace, patch = parse_arguments(argv)
    return asyncio.run(_label_namespace(namespace, patch))


async def _label_namespace(namespace: str, patch: dict[str, Any]) -> int:
    from kubespawner.clients import (  # type: ignore[import-untyped]
        load_config,
        shared_client,
    )

    await asyncio.to_thread(load_config)
    api = shared_client("CoreV1Api")
    try:
        await api.patch_namespace(namespace, patch, _content_type="application/merge-patch+json")
    finally:
        await api.api_client.close()
    labels = ", ".join(f"{k}={v}" for k, v in patch["metadata"]["labels"].items())
    print(f"namespace {namespace} labelled {labels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
