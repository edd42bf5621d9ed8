"""A pod's volumes as host directories: emptyDir, hostPath, PVC, configMap, secret, projected.

ConfigMaps and Secrets are written once when the pod starts (no live updates). The result feeds
launcher.py, which bind-mounts each source at its mountPath in the pod's mount namespace.

fsGroup is applied as the kubelet does (podsecurity.set_volume_ownership) to the volumes whose
plugins support ownership management: emptyDir, configMap, secret, downwardAPI, projected, and
claims of the agent's own class `gpulab-local` (like a CSI driver with fsGroupPolicy File); never
to hostPath, which stays as the host has it. emptyDir folders are 0777, as the kubelet makes them.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from .kube import raw, status_of
from .podenv import field_value
from .podsecurity import set_volume_ownership
from .volumes import STORAGE_CLASS


class MountError(RuntimeError):
    """A volume cannot be set up yet (kubelet's FailedMount); retried until the pod goes away."""


async def _get(call: Any, kind: str, name: str, optional: bool) -> dict[str, Any] | None:
    try:
        return await raw(call)
    except Exception as e:
        if status_of(e) == 404:
            if optional:
                return None
            raise MountError(f'{kind} "{name}" not found') from e
        raise


def _write_items(
    target: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int | None
) -> None:
    chosen = (
        [(i["key"], i["path"], i.get("mode")) for i in items]
        if items
        else [(k, k, None) for k in data]
    )
    for key, rel, item_mode in chosen:
        if key not in data:
            raise MountError(f'key "{key}" not found')
        f = target / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data[key])
        os.chmod(f, item_mode if item_mode is not None else (mode if mode is not None else 0o644))


def _cm_bytes(obj: dict[str, Any]) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


def _secret_bytes(obj: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}


def _ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _host_path(hp: dict[str, Any]) -> Path:
    """hostPath with its type check: DirectoryOrCreate/FileOrCreate create, others must exist."""
    path, kind = Path(hp["path"]), hp.get("type") or ""
    if kind in ("", "DirectoryOrCreate") and not path.exists():
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    elif not path.exists():
        raise MountError(f"hostPath type check failed: {path} is not a {kind}")
    return path


async def prepare(
    core: client.CoreV1Api, pod: dict[str, Any], pod_dir: Path, *, fs_group: int | None = None
) -> dict[str, tuple[Path, bool]]:
    """Volume name -> (host source path, read-only) for every volume of the pod, group-owned by
    `fs_group` where the kubelet would make them so."""
    managed: set[str] = set()
    out = await _prepare(core, pod, pod_dir, managed)
    if fs_group is not None:
        for name in sorted(managed):
            path, read_only = out[name]
            await asyncio.to_thread(set_volume_ownership, path, fs_group, read_only=read_only)
    return out


_OWNERSHIP_MANAGED = ("emptyDir", "configMap", "secret", "downwardAPI", "projected")


async def _prepare(
    core: client.CoreV1Api, pod: dict[str, Any], pod_dir: Path, managed: set[str]
) -> dict[str, tuple[Path, bool]]:
    """The volumes; the names of those whose ownership the kubelet manages added to `managed`."""
    ns = pod["metadata"]["namespace"]
    out: dict[str, tuple[Path, bool]] = {}
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        name = vol["name"]
        if any(k in vol for k in _OWNERSHIP_MANAGED):
            managed.add(name)
        target = pod_dir / "volumes" / name
        if "emptyDir" in vol:
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o777)  # the kubelet's emptyDir mode: any uid of the pod may write
            out[name] = (target, False)
        elif "hostPath" in vol:
            out[name] = (_host_path(vol["hostPath"]), False)
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            pvc = await _get(
                core.read_namespaced_persistent_volume_claim(claim, ns, _preload_content=False),
                "persistentvolumeclaim",
                claim,
                False,
            )
            assert pvc is not None
            pv_name = (pvc.get("spec") or {}).get("volumeName")
            if not pv_name or (pvc.get("status") or {}).get("phase") != "Bound":
                raise MountError(f'persistentvolumeclaim "{claim}" is not bound')
            pv = await _get(
                core.read_persistent_volume(pv_name, _preload_content=False),
                "persistentvolume",
                pv_name,
                False,
            )
            assert pv is not None
            pv_spec = pv.get("spec") or {}
            src = (pv_spec.get("hostPath") or pv_spec.get("local") or {}).get("path")
            if not src:
                raise MountError(f'persistentvolume "{pv_name}" has no hostPath or local path')
            out[name] = (_ensure_dir(Path(src)), bool(vol["persistentVolumeClaim"].get("readOnly")))
            if pv_spec.get("storageClassName") == STORAGE_CLASS:
                managed.add(name)
        elif "configMap" in vol or "secret" in vol:
            is_secret = "secret" in vol
            src = vol["secret" if is_secret else "configMap"]
            obj_name = src.get("secretName" if is_secret else "name")
            if is_secret:
                call = core.read_namespaced_secret(obj_name, ns, _preload_content=False)
            else:
                call = core.read_namespaced_config_map(obj_name, ns, _preload_content=False)
            kind = "secret" if is_secret else "configmap"
            obj = await _get(call, kind, obj_name, bool(src.get("optional")))
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            if obj is not None:
                data = _secret_bytes(obj) if is_secret else _cm_bytes(obj)
                _write_items(target, data, src.get("items"), src.get("defaultMode"))
            out[name] = (target, True)
        elif "downwardAPI" in vol:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            _downward(target, pod, vol["downwardAPI"].get("items") or [])
            out[name] = (target, True)
        elif "projected" in vol:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            await _projected(core, pod, target, vol["projected"])
            out[name] = (target, True)
        else:
            kinds = [k for k in vol if k != "name"]
            raise MountError(
                f"volume {name!r}: type {kinds} is not supported by the gpulab node agent "
                "(emptyDir, hostPath, persistentVolumeClaim, configMap, secret, downwardAPI, projected are)"
            )
    return out


def _downward(target: Path, pod: dict[str, Any], items: list[dict[str, Any]]) -> None:
    for item in items:
        if "fieldRef" in item:
            f = target / item["path"]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(field_value(pod, item["fieldRef"]["fieldPath"]))


async def _projected(
    core: client.CoreV1Api, pod: dict[str, Any], target: Path, spec: dict[str, Any]
) -> None:
    ns = pod["metadata"]["namespace"]
    for source in spec.get("sources") or []:
        if "configMap" in source or "secret" in source:
            is_secret = "secret" in source
            src = source["secret" if is_secret else "configMap"]
            if is_secret:
                call = core.read_namespaced_secret(src["name"], ns, _preload_content=False)
            else:
                call = core.read_namespaced_config_map(src["name"], ns, _preload_content=False)
            obj = await _get(
                call, "secret" if is_secret else "configmap", src["name"], bool(src.get("optional"))
            )
            if obj is not None:
                data = _secret_bytes(obj) if is_secret else _cm_bytes(obj)
                _write_items(target, data, src.get("items"), spec.get("defaultMode"))
        elif "downwardAPI" in source:
            _downward(target, pod, source["downwardAPI"].get("items") or [])
        elif "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            sa = (pod.get("spec") or {}).get("serviceAccountName") or "default"
            body = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [sat["audience"]] if sat.get("audience") else [],
                    "expirationSeconds": int(sat.get("expirationSeconds") or 3600),
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": pod["metadata"]["name"],
                        "uid": pod["metadata"]["uid"],
                    },
                },
            }
            resp = await raw(
                core.create_namespaced_service_account_token(sa, ns, body, _preload_content=False)
            )
            f = target / sat["path"]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(resp["status"]["token"])
