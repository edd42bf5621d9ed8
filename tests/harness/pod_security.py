"""Pod Security Standards' `restricted` level (latest) as a check of a pod spec, for unit tests of
the manifests gpulab builds: the rules Kubernetes' PodSecurity admission applies
(k8s.io/pod-security-admission/policy), baseline's included, on every container: containers,
init containers (native sidecars among them) and ephemeral containers.

The API server's own verdict is the dev-cluster test's (tests/spawner/kube/test_isolation.py),
which also checks that this check and the API server agree on a pod they refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the volume types `restricted` allows (hostPath and the in-tree network volumes are not)
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECCOMP_ALLOWED = {"RuntimeDefault", "Localhost"}
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")


def _containers(spec: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [
        (f"{kind} {c.get('name')!r}", c)
        for kind in ("containers", "initContainers", "ephemeralContainers")
        for c in spec.get(kind) or []
    ]


def restricted_violations(spec: Mapping[str, Any]) -> list[str]:
    """What `restricted` refuses in a pod spec, one line each ([] for a pod it admits)."""
    out: list[str] = []
    psc = spec.get("securityContext") or {}
    for field in HOST_NAMESPACES:
        if spec.get(field):
            out.append(f"pod: {field}")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume.get('name')!r}: {', '.join(sorted(kinds))}")
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_ALLOWED:
        out.append(f"pod: seccompProfile {pod_seccomp}")
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    for where, c in _containers(spec):
        csc = c.get("securityContext") or {}
        if csc.get("privileged"):
            out.append(f"{where}: privileged")
        if csc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = csc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities do not drop ALL")
        added = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            out.append(f"{where}: adds capabilities {', '.join(sorted(added))}")
        non_root = csc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"{where}: runAsNonRoot is not true")
        if csc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
        seccomp = (csc.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in SECCOMP_ALLOWED:
            out.append(f"{where}: seccompProfile {seccomp}")
        if seccomp is None and pod_seccomp is None:
            out.append(f"{where}: no seccompProfile (pod or container)")
        if csc.get("procMount") not in (None, "Default"):
            out.append(f"{where}: procMount {csc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
    return out
