"""The dask-kubernetes operator's CRDs made acceptable to an API server that takes no `$ref` (every one: 1.20 and the dev cluster's 1.37 alike) (pure:
gpulab.spawner.kube.dask_operator): `$ref`s resolved (within a document and across documents,
cycles refused), OpenAPI v2 made structural, the package's JSON patches applied, and the
installed package's four CRDs resolved against a small OpenAPI document with no `$ref` left.
(The dev cluster refusing the unresolved CRD and taking the resolved ones is in the kube tests:
the operator fixture of tests/spawner/kube/test_dask.py applies them.)"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gpulab.spawner.kube.dask_operator import (
    CRD_NAMES,
    RefError,
    apply_json_patch,
    operator_command,
    operator_crds,
    resolve_refs,
    structural,
)


def test_refs_are_replaced_within_and_across_documents_leaving_the_inputs_untouched() -> None:
    templates = {
        "definitions": {
            "Meta": {"type": "object", "properties": {"labels": {"type": "object"}}},
            "Worker": {
                "type": "object",
                "properties": {
                    "metadata": {"$ref": "#/definitions/Meta"},
                    "spec": {"$ref": "k8s.json#/definitions/io.k8s.api.core.v1.PodSpec"},
                },
            },
        }
    }
    k8s = {
        "definitions": {
            "io.k8s.api.core.v1.PodSpec": {
                "type": "object",
                "properties": {
                    "containers": {
                        "type": "array",
                        "items": {"$ref": "#/definitions/io.k8s.api.core.v1.Container"},
                    }
                },
            },
            "io.k8s.api.core.v1.Container": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
            },
        }
    }
    documents = {"templates.yaml": templates, "k8s.json": k8s}
    before = copy.deepcopy(documents)
    crd = {"schema": {"$ref": "templates.yaml#/definitions/Worker"}}
    assert resolve_refs(crd, documents) == {
        "schema": {
            "type": "object",
            "properties": {
                "metadata": {"type": "object", "properties": {"labels": {"type": "object"}}},
                "spec": {
                    "type": "object",
                    "properties": {
                        "containers": {
                            "type": "array",
                            "items": {"type": "object", "properties": {"name": {"type": "string"}}},
                        }
                    },
                },
            },
        }
    }
    assert documents == before
    # a function may stand for the documents
    assert resolve_refs(
        {"$ref": "k8s.json#/definitions/io.k8s.api.core.v1.Container"}, documents.__getitem__
    ) == {
        "type": "object",
        "properties": {"name": {"type": "string"}},
    }


def test_cycles_unknown_documents_and_missing_definitions_are_refused_by_name() -> None:
    cyclic = {
        "definitions": {
            "A": {"properties": {"b": {"$ref": "#/definitions/B"}}},
            "B": {"$ref": "#/definitions/A"},
        }
    }
    with pytest.raises(RefError, match="cycle"):
        resolve_refs({"$ref": "d#/definitions/A"}, {"d": cyclic})
    with pytest.raises(RefError, match="unknown document 'elsewhere.json'"):
        resolve_refs({"$ref": "elsewhere.json#/definitions/A"}, {"d": cyclic})
    with pytest.raises(RefError, match="nothing at '/definitions/C'"):
        resolve_refs({"$ref": "d#/definitions/C"}, {"d": cyclic})


def test_openapi_v2_becomes_a_structural_crd_schema() -> None:
    schema = {
        "description": "a container port",
        "type": "object",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-patch-merge-key": "containerPort",
        "x-kubernetes-patch-strategy": "merge",
        "properties": {
            "port": {"description": "number or name", "type": "string", "format": "int-or-string"},
            "description": {"type": "string"},  # a field named description stays
            "count": {"type": "integer", "format": "int32"},
        },
    }
    assert structural(schema) == {
        "type": "object",
        "x-kubernetes-list-type": "map",
        "properties": {
            "port": {"x-kubernetes-int-or-string": True},
            "description": {"type": "string"},
            "count": {"type": "integer", "format": "int32"},
        },
    }


def test_list_map_keys_neither_required_nor_defaulted_get_kubernetes_defaults() -> None:
    """Kubernetes 1.3x's OpenAPI v2 leaves `ephemeralContainers[].ports[].protocol` and
    `imagePullSecrets[].name` optional without a default, which a CRD may not have."""

    def list_map(keys: list[str], properties: dict[str, object], required: list[str]) -> dict:
        items = {"type": "object", "properties": properties, "required": required}
        return {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": keys,
            "items": items,
        }

    ports = list_map(
        ["containerPort", "protocol"],
        {"containerPort": {"type": "integer"}, "protocol": {"type": "string"}},
        ["containerPort"],
    )
    secrets = list_map(["name"], {"name": {"type": "string"}}, [])
    kept = list_map(["name"], {"name": {"type": "string", "default": "x"}}, [])
    out = structural({"type": "object", "properties": {"p": ports, "s": secrets, "k": kept}})
    p, s, k = (out["properties"][n]["items"]["properties"] for n in "psk")
    assert p == {
        "containerPort": {"type": "integer"},
        "protocol": {"type": "string", "default": "TCP"},
    }
    assert s == {"name": {"type": "string", "default": ""}}
    assert k == {"name": {"type": "string", "default": "x"}}
    assert ports["items"]["properties"]["protocol"] == {"type": "string"}  # the input untouched


def test_json_patches_add_replace_and_remove_on_a_copy() -> None:
    document = {"a": {"b": [{"c": 1}]}}
    patched = apply_json_patch(
        document,
        [
            {"op": "add", "path": "/a/b/0/d", "value": "TCP"},
            {"op": "replace", "path": "/a/b/0/c", "value": 2},
            {"op": "add", "path": "/a/b/-", "value": {"e": 3}},
            {"op": "remove", "path": "/a/b/1"},
        ],
    )
    assert patched == {"a": {"b": [{"c": 2, "d": "TCP"}]}}
    assert document == {"a": {"b": [{"c": 1}]}}
    with pytest.raises(ValueError, match="nothing at"):
        apply_json_patch(document, [{"op": "add", "path": "/x/y", "value": 1}])
    with pytest.raises(ValueError, match="no 'z' to remove"):
        apply_json_patch(document, [{"op": "remove", "path": "/a/z"}])


def port_schema() -> dict[str, Any]:
    return {
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["containerPort", "protocol"],
        "items": {
            "type": "object",
            "required": ["containerPort"],
            "properties": {
                "containerPort": {"type": "integer", "format": "int32"},
                "protocol": {"type": "string", "description": "TCP, UDP or SCTP"},
            },
        },
    }


#: the part of a Kubernetes /openapi/v2 document the dask CRDs refer to (PodSpec, ServiceSpec)
OPENAPI = {
    "swagger": "2.0",
    "definitions": {
        "io.k8s.api.core.v1.PodSpec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "containers": {
                    "type": "array",
                    "items": {"$ref": "#/definitions/io.k8s.api.core.v1.Container"},
                },
                "initContainers": {
                    "type": "array",
                    "items": {"$ref": "#/definitions/io.k8s.api.core.v1.Container"},
                },
                "restartPolicy": {"type": "string"},
            },
        },
        "io.k8s.api.core.v1.Container": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "ports": port_schema()},
        },
        "io.k8s.api.core.v1.ServiceSpec": {
            "type": "object",
            "properties": {
                "ports": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "port": {"type": "integer", "format": "int32"},
                            "protocol": {"type": "string"},
                            "targetPort": {"type": "string", "format": "int-or-string"},
                        },
                    },
                },
                "type": {"type": "string"},
            },
        },
    },
}


def test_the_installed_operators_crds_resolve_against_the_clusters_openapi() -> None:
    crds = operator_crds(OPENAPI)
    assert [c["metadata"]["name"] for c in crds] == [
        f"{name}s.kubernetes.dask.org" for name in CRD_NAMES
    ]
    text = json.dumps(crds)
    assert "$ref" not in text and "k8s_crd_resolver" not in text
    cluster = crds[0]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    scheduler = cluster["properties"]["scheduler"]["properties"]
    container = scheduler["spec"]["properties"]["containers"]["items"]
    assert container["required"] == ["name"]
    # the package's patch: list-map keys need a default (the API server requires it)
    assert container["properties"]["ports"]["items"]["properties"]["protocol"] == {
        "type": "string",
        "default": "TCP",
    }
    service_port = scheduler["service"]["properties"]["ports"]["items"]["properties"]
    assert service_port["targetPort"] == {"x-kubernetes-int-or-string": True}
    assert service_port["protocol"]["default"] == "TCP"
    worker = crds[1]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    worker_spec = worker["properties"]["worker"]["properties"]["spec"]
    assert worker_spec["properties"]["restartPolicy"] == {"type": "string"}


def test_the_operator_runs_as_its_image_starts_it() -> None:
    assert operator_command("/usr/bin/python3") == [
        "/usr/bin/python3",
        "-m",
        "kopf",
        "run",
        "-m",
        "dask_kubernetes.operator.controller",
        "--all-namespaces",
    ]
    assert (
        operator_command("py", liveness_port=8080)[-1] == "--liveness=http://0.0.0.0:8080/healthz"
    )
