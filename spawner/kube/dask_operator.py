"""The dask-kubernetes operator in a cluster gpulab runs Dask clusters on: its CRDs and its process.

gpulab does not build its own controller: the real operator (`dask_kubernetes.operator.controller`,
a kopf operator) reconciles the `DaskCluster` and `DaskWorkerGroup` objects gpulab's hub creates
(`dask_objects`) into the scheduler's Deployment and Service and one Deployment per worker.

CRDs. dask-kubernetes ships its CRDs as templates (`operator/customresources/*.yaml`) whose
schemas are `$ref`s into a template file of its own and into Kubernetes' OpenAPI definitions
(`python://k8s_crd_resolver/schemata/k8s-1.21.1.json#/definitions/io.k8s.api.core.v1.PodSpec`),
plus a JSON patch per CRD (`*.patch.yaml`: defaults the API server requires for list-map keys).
`apiextensions.k8s.io/v1` takes no `$ref` (Kubernetes answers 422, 1.20.2 and 1.37.2 alike:
"$ref: Forbidden: $ref is not supported"), so they are resolved here: `resolve_refs` (pure) puts
the referenced schemas in place, against the *cluster's own* OpenAPI document (`/openapi/v2`), so
the pod and service schemas are exactly what that API server validates; `structural` makes the
result a structural schema (int-or-string as `x-kubernetes-int-or-string`, no merge-patch
annotations, no descriptions: the resolved DaskJob would otherwise pass etcd's object size);
then the package's patch is applied (`apply_json_patch`). dask-kubernetes' own Helm chart ships
CRDs resolved against Kubernetes 1.21.1's schemas, not the cluster's; gpulab's does not.

Who calls this: `python -m gpulab.spawner.kube.dask_operator install-crds` (an admin, once per
cluster and dask-kubernetes upgrade; gpulab's Helm chart runs it in a pre-install and pre-upgrade
hook Job, helm/gpulab/templates/dask/crds-job.yaml), `... run` (the operator,
`operator_command`, with the kubeconfig of `KUBECONFIG` or the pod's service account, as the
chart's Deployment does), and the tests' fixtures (`install_crds`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.resources
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import yaml

#: the CRDs gpulab uses (the operator watches all four: DaskJob and DaskAutoscaler are applied too,
#: or it logs errors for resources the API server does not know)
CRD_NAMES = ("daskcluster", "daskworkergroup", "daskjob", "daskautoscaler")
CRD_PACKAGE = "dask_kubernetes.operator"
CRD_FOLDER = "customresources"
#: what the templates' `$ref`s into Kubernetes' definitions start with: resolved against the
#: cluster's own OpenAPI document
KUBERNETES_SCHEMATA = "python://k8s_crd_resolver/schemata/"
#: the operator's module, as its image starts it (dask-kubernetes' Dockerfile)
OPERATOR_MODULE = "dask_kubernetes.operator.controller"
#: OpenAPI vendor extensions that are no part of a CRD's JSONSchemaProps
NOT_IN_CRDS = (
    "x-kubernetes-patch-merge-key",
    "x-kubernetes-patch-strategy",
    "x-kubernetes-group-version-kind",
    "x-kubernetes-unions",
)


class RefError(ValueError):
    """A `$ref` that names no document or definition, or refers to itself."""


def _split(uri: str, base: str) -> tuple[str, str]:
    document, _, pointer = uri.partition("#")
    return (document or base), pointer


def _pointer(document: Any, pointer: str, uri: str) -> Any:
    node = document
    for raw in [p for p in pointer.split("/") if p]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise RefError(f"$ref {uri!r}: nothing at {pointer!r}")
    return node


def resolve_refs(
    node: Any, documents: Mapping[str, Any] | Callable[[str], Any], base: str = ""
) -> Any:
    """`node` with every `{"$ref": uri}` replaced by what it refers to, recursively (pure: a new
    value, the inputs untouched). `documents` maps a document's URI (the part before `#`) to its
    content, or is a function doing so (raising KeyError for an unknown one); a `#/...` ref is
    within the document the referring schema came from (`base` for `node` itself). Sibling keys
    of a `$ref` are ignored, as OpenAPI v2 says. A ref cycle raises RefError (a CRD schema cannot
    be recursive)."""

    def document(uri: str) -> Any:
        try:
            return documents(uri) if callable(documents) else documents[uri]
        except KeyError:
            raise RefError(f"$ref to an unknown document {uri!r}") from None

    def walk(value: Any, base: str, seen: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str):
                doc_uri, pointer = _split(ref, base)
                key = f"{doc_uri}#{pointer}"
                if key in seen:
                    raise RefError(f"$ref cycle: {' -> '.join([*seen, key])}")
                target = _pointer(document(doc_uri), pointer, ref)
                return walk(target, doc_uri, (*seen, key))
            return {k: walk(v, base, seen) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, base, seen) for v in value]
        return value

    return walk(node, base, ())


def structural(schema: Any) -> Any:
    """An OpenAPI v2 schema (Kubernetes' definitions, resolved) as a CRD's structural schema:
    `type: string, format: int-or-string` becomes `x-kubernetes-int-or-string: true` (ports and
    probes' ports take numbers and names), the vendor extensions a CRD schema has no field for
    and every description are dropped, and list-map keys that are neither required nor
    defaulted get their defaults (pure)."""
    if isinstance(schema, list):
        return [structural(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in NOT_IN_CRDS or (key == "description" and isinstance(value, str)):
            continue
        if key in ("properties", "definitions", "patternProperties"):
            out[key] = {name: structural(v) for name, v in value.items()}
        else:
            out[key] = structural(value)
    if out.get("format") == "int-or-string":
        out.pop("format")
        out.pop("type", None)
        out["x-kubernetes-int-or-string"] = True
    _default_list_map_keys(out)
    return out


#: the defaults Kubernetes' own defaulting gives list-map keys that are not required (a port's
#: protocol); other optional string keys default to "" as in Kubernetes' OpenAPI v3 document
LIST_MAP_KEY_DEFAULTS = {"protocol": "TCP"}


def _default_list_map_keys(schema: dict[str, Any]) -> None:
    """A CRD's list-map key must be required or have a default (the API server refuses the CRD
    otherwise); Kubernetes' OpenAPI v2 document leaves some without either (1.3x: the ports of
    ephemeral containers, `imagePullSecrets[].name`), so give them their defaults."""
    items = schema.get("items")
    keys = schema.get("x-kubernetes-list-map-keys")
    if not isinstance(items, dict) or not isinstance(keys, list):
        return
    required = set(items.get("required") or ())
    properties = items.get("properties") or {}
    for key in keys:
        prop = properties.get(key)
        if key in required or not isinstance(prop, dict) or "default" in prop:
            continue
        if key in LIST_MAP_KEY_DEFAULTS:
            prop["default"] = LIST_MAP_KEY_DEFAULTS[key]
        elif prop.get("type") == "string":
            prop["default"] = ""


def apply_json_patch(document: Any, operations: Sequence[Mapping[str, Any]]) -> Any:
    """RFC 6902 `add`, `replace` and `remove` applied to a copy of `document` (the operations the
    dask-kubernetes CRD patches use); a path that does not exist raises ValueError."""
    result = copy.deepcopy(document)
    for op in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(op["path"]).split("/")[1:]]
        if not parts:
            raise ValueError("a patch of the whole document is not supported")
        parent = _pointer(result, "/" + "/".join(parts[:-1]), str(op["path"]))
        last, kind = parts[-1], op["op"]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                parent[index] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[index]
            else:
                raise ValueError(f"unsupported patch operation {kind!r}")
            continue
        if not isinstance(parent, dict):
            raise ValueError(f"patch path {op['path']!r} does not end in an object")
        if kind in ("replace", "remove") and last not in parent:
            raise ValueError(f"patch path {op['path']!r}: no {last!r} to {kind}")
        if kind in ("add", "replace"):
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[last]
        else:
            raise ValueError(f"unsupported patch operation {kind!r}")
    return result


def crd_schemas_resolved(crd: Mapping[str, Any]) -> dict[str, Any]:
    """`crd` with each version's `openAPIV3Schema` made structural (after `resolve_refs`)."""
    out = copy.deepcopy(dict(crd))
    for version in out["spec"]["versions"]:
        schema = version.get("schema") or {}
        if "openAPIV3Schema" in schema:
            schema["openAPIV3Schema"] = structural(schema["openAPIV3Schema"])
    return out


# -- the package's files ---------------------------------------------------------------------------


def _package_file(name: str) -> Any:
    text = importlib.resources.files(CRD_PACKAGE).joinpath(CRD_FOLDER, name).read_text()
    return yaml.safe_load(text)


def _document_loader(openapi: Mapping[str, Any]) -> Callable[[str], Any]:
    cache: dict[str, Any] = {}

    def load(uri: str) -> Any:
        if uri.startswith(KUBERNETES_SCHEMATA):
            return openapi  # the cluster's own definitions, whatever version the ref names
        prefix = f"python://{CRD_PACKAGE.replace('.', '/')}/{CRD_FOLDER}/"
        if not uri.startswith(prefix):
            raise KeyError(uri)
        if uri not in cache:
            cache[uri] = _package_file(uri[len(prefix) :])
        return cache[uri]

    return load


def operator_crds(openapi: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The operator's CRDs from the installed dask-kubernetes, resolved against `openapi` (the
    cluster's `/openapi/v2` document), made structural and patched: ready to create."""
    load = _document_loader(openapi)
    crds = []
    for name in CRD_NAMES:
        template = _package_file(f"{name}.yaml")
        resolved = crd_schemas_resolved(resolve_refs(template, load))
        patch = _package_file(f"{name}.patch.yaml")
        crds.append(apply_json_patch(resolved, patch or []))
    return crds


# -- the cluster -----------------------------------------------------------------------------------


async def install_crds(api_client: Any) -> list[str]:
    """Create (or replace) the operator's CRDs in the cluster of `api_client` (a
    kubernetes_asyncio ApiClient) and wait until the API server serves them; their names."""
    from kubernetes_asyncio.client import ApiextensionsV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    response = await api_client.call_api(
        "/openapi/v2", "GET", auth_settings=["BearerToken"], _preload_content=False
    )
    try:
        openapi = json.loads(await response.read())
    finally:
        response.release()
    api = ApiextensionsV1Api(api_client)
    names = []
    for crd in operator_crds(openapi):
        name = crd["metadata"]["name"]
        names.append(name)
        try:
            await api.create_custom_resource_definition(cast(Any, crd))  # a dict is a body
        except ApiException as e:
            if e.status != 409:
                raise
            current = await api.read_custom_resource_definition(name)
            crd["metadata"]["resourceVersion"] = current.metadata.resource_version
            await api.replace_custom_resource_definition(name, cast(Any, crd))
    for name in names:
        for _ in range(300):
            current = await api.read_custom_resource_definition(name)
            conditions = current.status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"CRD {name} was not established within 30 s")
    return names


def operator_command(
    python: str = sys.executable, *, liveness_port: int | None = None
) -> list[str]:
    """The operator's command line, as dask-kubernetes' image runs it (`kopf run -m
    dask_kubernetes.operator.controller --all-namespaces`); `liveness_port` adds its health
    endpoint (the chart's probe)."""
    command = [python, "-m", "kopf", "run", "-m", OPERATOR_MODULE, "--all-namespaces"]
    if liveness_port is not None:
        command.append(f"--liveness=http://0.0.0.0:{liveness_port}/healthz")
    return command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpulab.spawner.kube.dask_operator",
        description="Install the dask-kubernetes operator's CRDs, or run the operator, in the "
        "cluster of KUBECONFIG (or the pod's service account).",
    )
    parser.add_argument("action", choices=["install-crds", "run", "print-crds"])
    args = parser.parse_args(argv)
    if args.action == "run":
        command = operator_command()
        os.execv(command[0], command)
    return asyncio.run(_cli(args.action))


async def _cli(action: str) -> int:
    from kubespawner.clients import (  # type: ignore[import-untyped]
        load_config,
        shared_client,
    )

    await asyncio.to_thread(load_config)
    api_client = shared_client("CoreV1Api").api_client
    try:
        if action == "install-crds":
            for name in await install_crds(api_client):
                print(f"customresourcedefinition {name} applied")
        else:
            response = await api_client.call_api(
                "/openapi/v2", "GET", auth_settings=["BearerToken"], _preload_content=False
            )
            openapi = json.loads(await response.read())
            response.release()
            print(json.dumps(operator_crds(openapi), indent=1))
    finally:
        await api_client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
