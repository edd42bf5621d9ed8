"""A container's environment, command line and resource values, as a kubelet computes them (pure)."""

from __future__ import annotations

import base64
import math
import re
from typing import Any

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, value)


def field_value(pod: dict[str, Any], path: str) -> str:
    """fieldRef.fieldPath of the downward API (metadata.name, status.podIP, metadata.labels['x'] ...)."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.podIPs": status.get("podIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ValueError(f"unsupported fieldRef.fieldPath {path!r}")


_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "m": 0.001,
}


def quantity(q: str | int | float) -> float:
    s = str(q)
    for suffix, factor in _SUFFIX.items():
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * factor
    return float(s)


def resource_value(
    container: dict[str, Any], ref: dict[str, Any], node_capacity: dict[str, str]
) -> str:
    """resourceFieldRef: limits.cpu, requests.memory ... divided by divisor, rounded up."""

    kind, _, name = ref["resource"].partition(".")
    res = (container.get("resources") or {}).get(kind) or {}
    raw = res.get(name)
    if raw is None and kind == "limits":  # unset limits read as the node's allocatable
        raw = node_capacity.get(name, "0")
    if raw is None:
        raw = "0"
    divisor = quantity(ref.get("divisor", "1") or "1")
    return str(math.ceil(quantity(raw) / divisor))


def _data(obj: dict[str, Any] | None, *, secret: bool) -> dict[str, str]:
    if not obj:
        return {}
    out = dict(obj.get("data") or {})
    if secret:
        out = {k: base64.b64decode(v).decode(errors="replace") for k, v in out.items()}
        out.update(obj.get("stringData") or {})
    else:
        out.update(
            {
                k: base64.b64decode(v).decode(errors="replace")
                for k, v in (obj.get("binaryData") or {}).items()
            }
        )
    return out


class EnvError(ValueError):
    """A referenced ConfigMap/Secret key is missing: the container cannot start."""


def container_env(
    pod: dict[str, Any],
    container: dict[str, Any],
    *,
    base: dict[str, str],
    configmaps: dict[str, dict[str, Any] | None],
    secrets: dict[str, dict[str, Any] | None],
    node_capacity: dict[str, str],
) -> dict[str, str]:
    """base, then envFrom, then env (with $(VAR) and valueFrom)."""
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            ref, objs, is_secret = src["configMapRef"], configmaps, False
        elif "secretRef" in src:
            ref, objs, is_secret = src["secretRef"], secrets, True
        else:
            continue
        obj = objs.get(ref["name"])
        if obj is None and not ref.get("optional"):
            kind = "secret" if is_secret else "configmap"
            raise EnvError(f'{kind} "{ref["name"]}" not found')
        for k, v in _data(obj, secret=is_secret).items():
            env[prefix + k] = v
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item.get("value") or ""), env)
            continue
        vf = item.get("valueFrom") or {}
        if "fieldRef" in vf:
            env[name] = field_value(pod, vf["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in vf:
            env[name] = resource_value(container, vf["resourceFieldRef"], node_capacity)
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            is_secret = "secretKeyRef" in vf
            ref = vf["secretKeyRef" if is_secret else "configMapKeyRef"]
            obj = (secrets if is_secret else configmaps).get(ref["name"])
            data = _data(obj, secret=is_secret)
            if ref["key"] in data:
                env[name] = data[ref["key"]]
            elif not ref.get("optional"):
                kind = "secret" if is_secret else "configmap"
                what = "not found" if obj is None else f'has no key "{ref["key"]}"'
                raise EnvError(f'{kind} "{ref["name"]}" {what} (env {name})')
        else:
            env[name] = ""
    return env


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded."""
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    return [expand(str(a), env) for a in argv]


def referenced_objects(pod: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Names of ConfigMaps and Secrets that containers' env/envFrom refer to."""
    cms, secs = set(), set()
    spec = pod.get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for src in c.get("envFrom") or []:
            if "configMapRef" in src:
                cms.add(src["configMapRef"]["name"])
            if "secretRef" in src:
                secs.add(src["secretRef"]["name"])
        for item in c.get("env") or []:
            vf = item.get("valueFrom") or {}
            if "configMapKeyRef" in vf:
                cms.add(vf["configMapKeyRef"]["name"])
            if "secretKeyRef" in vf:
                secs.add(vf["secretKeyRef"]["name"])
    return cms, secs
