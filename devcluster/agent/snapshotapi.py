"""The ``snapshot.storage.k8s.io/v1`` API as the dev cluster installs it at start: the three
CustomResourceDefinitions (VolumeSnapshotClass, VolumeSnapshot, VolumeSnapshotContent) and the
default VolumeSnapshotClass ``gpulab-local`` of driver ``gpulab.io/local``.

Pure builders (no client library): `cluster.DevCluster` posts them, `snapshots.SnapshotController`
acts on the objects.
"""

from __future__ import annotations

from typing import Any

from gpulab.spawner.names import SNAPSHOT_FILES_ANNOTATION

GROUP = "snapshot.storage.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
DRIVER = "gpulab.io/local"
SNAPSHOT_CLASS = "gpulab-local"
DEFAULT_CLASS_ANNOTATION = "snapshot.storage.kubernetes.io/is-default-class"
#: file count of a snapshot, shown by the workspaces page (the kube workspace backend reads it)
FILES_ANNOTATION = SNAPSHOT_FILES_ANNOTATION

# -- the API: CustomResourceDefinitions (apiextensions.k8s.io/v1, structural schemas) ----------

_STR = {"type": "string"}
_ERROR = {
    "type": "object",
    "properties": {"message": _STR, "time": {"type": "string", "format": "date-time"}},
}
_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
_DELETION_POLICY = {"type": "string", "enum": ["Delete", "Retain"]}


def _crd(kind: str, plural: str, scope: str, schema: dict[str, Any], columns: list[Any]) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "annotations": {
                "api-approved.kubernetes.io": "https://github.com/kubernetes-csi/external-snapshotter/pull/419"
            },
        },
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": {
                    "VolumeSnapshot": ["vs"],
                    "VolumeSnapshotContent": ["vsc", "vscs"],
                    "VolumeSnapshotClass": ["vsclass", "vsclasses"],
                }[kind],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "additionalPrinterColumns": columns,
                    **({"subresources": {"status": {}}} if kind != "VolumeSnapshotClass" else {}),
                }
            ],
        },
    }


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": {"type": "object"},
            **properties,
        },
    }


def crds() -> list[dict[str, Any]]:
    """The three CRDs of snapshot.storage.k8s.io/v1 with the fields that matter."""
    snapshot = _object(
        {
            "spec": {
                "type": "object",
                "required": ["source"],
                "properties": {
                    "source": {
                        "type": "object",
                        "properties": {
                            "persistentVolumeClaimName": _STR,
                            "volumeSnapshotContentName": _STR,
                        },
                        "oneOf": [
                            {"required": ["persistentVolumeClaimName"]},
                            {"required": ["volumeSnapshotContentName"]},
                        ],
                    },
                    "volumeSnapshotClassName": _STR,
                },
            },
            "status": {
                "type": "object",
                "properties": {
                    "boundVolumeSnapshotContentName": _STR,
                    "creationTime": {"type": "string", "format": "date-time"},
                    "readyToUse": {"type": "boolean"},
                    "restoreSize": _QUANTITY,
                    "error": _ERROR,
                },
            },
        },
        ["spec"],
    )
    content = _object(
        {
            "spec": {
                "type": "object",
                "required": ["deletionPolicy", "driver", "source", "volumeSnapshotRef"],
                "properties": {
                    "deletionPolicy": _DELETION_POLICY,
                    "driver": _STR,
                    "source": {
                        "type": "object",
                        "properties": {"snapshotHandle": _STR, "volumeHandle": _STR},
                        "oneOf": [{"required": ["snapshotHandle"]}, {"required": ["volumeHandle"]}],
                    },
                    "sourceVolumeMode": _STR,
                    "volumeSnapshotClassName": _STR,
                    "volumeSnapshotRef": {
                        "type": "object",
                        "properties": {
                            k: _STR
                            for k in (
                                "apiVersion",
                                "kind",
                                "name",
                                "namespace",
                                "uid",
                                "resourceVersion",
                                "fieldPath",
                            )
                        },
                    },
                },
            },
            "status": {
                "type": "object",
                "properties": {
                    "creationTime": {"type": "integer", "format": "int64"},
                    "readyToUse": {"type": "boolean"},
                    "restoreSize": {"type": "integer", "format": "int64", "minimum": 0},
                    "snapshotHandle": _STR,
                    "error": _ERROR,
                },
            },
        },
        ["spec"],
    )
    snapshot_class = _object(
        {
            "driver": _STR,
            "deletionPolicy": _DELETION_POLICY,
            "parameters": {"type": "object", "additionalProperties": _STR},
        },
        ["deletionPolicy", "driver"],
    )

    def col(name: str, path: str, type_: str = "string") -> dict[str, str]:
        return {"name": name, "type": type_, "jsonPath": path}

    age = col("Age", ".metadata.creationTimestamp", "date")
    return [
        _crd(
            "VolumeSnapshotClass",
            "volumesnapshotclasses",
            "Cluster",
            snapshot_class,
            [col("Driver", ".driver"), col("DeletionPolicy", ".deletionPolicy"), age],
        ),
        _crd(
            "VolumeSnapshotContent",
            "volumesnapshotcontents",
            "Cluster",
            content,
            [
                col("ReadyToUse", ".status.readyToUse", "boolean"),
                col("RestoreSize", ".status.restoreSize", "integer"),
                col("DeletionPolicy", ".spec.deletionPolicy"),
                col("Driver", ".spec.driver"),
                col("VolumeSnapshot", ".spec.volumeSnapshotRef.name"),
                age,
            ],
        ),
        _crd(
            "VolumeSnapshot",
            "volumesnapshots",
            "Namespaced",
            snapshot,
            [
                col("ReadyToUse", ".status.readyToUse", "boolean"),
                col("SourcePVC", ".spec.source.persistentVolumeClaimName"),
                col("RestoreSize", ".status.restoreSize"),
                col("SnapshotClass", ".spec.volumeSnapshotClassName"),
                col("SnapshotContent", ".status.boundVolumeSnapshotContentName"),
                age,
            ],
        ),
    ]


def snapshot_class() -> dict[str, Any]:
    """VolumeSnapshotClass gpulab-local (driver gpulab.io/local, the default class)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "VolumeSnapshotClass",
        "metadata": {"name": SNAPSHOT_CLASS, "annotations": {DEFAULT_CLASS_ANNOTATION: "true"}},
        "driver": DRIVER,
        "deletionPolicy": "Delete",
    }
