"""Lint, render and validate gpulab's chart without a cluster; the figures of `bash .ci/dev chart`.

    .venv/bin/python helm/tools/check.py

lints the chart strictly (the Helm engine of PyPI's helm-python-sdk) with the default values and
with ci/lint-values.yaml (every option on), for the dev cluster's Kubernetes version and current
ones; renders it with both; validates every rendered manifest against the Kubernetes API schemas
of those versions (strict: unknown fields are errors; the VolumeSnapshotClass against its CRD's
schema), and prints as its last line

    lint_warnings=<n> schema_errors=<n> validated_versions=<list> install_ready_s=<x> spawn_ok=<0|1>

then, where the dev cluster can run (root, gpulab.devcluster installed), installs the chart onto
a fresh one and spawns a GPU server through the installed hub (helm/tools/install.py):
install_ready_s is the seconds from the install call to the hub answering /hub/api through the
proxy's public Service, spawn_ok 1 when the server was ready. Elsewhere, or with --no-install,
the line says install_ready_s=nan spawn_ok=0 and stderr says why. tests/helm asserts the same
things one by one (the install in tests/helm/test_install.py, a `kube` test).

Schemas: kubernetes-validate's current release carries Kubernetes 1.25 and later; the dev
cluster's 1.20 comes from the same project's 1.28.0 release, which `bash .ci/dev setup` unpacks
into the venv (OLD_SCHEMAS) and which is applied the way kubernetes-validate applies its own.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "gpulab"
LINT_VALUES = CHART / "ci" / "lint-values.yaml"
#: where `bash .ci/dev setup` puts the Kubernetes API schemas of versions kubernetes-validate's
#: current release no longer carries (kubernetes-validate 1.28.0's folders, unchanged)
OLD_SCHEMAS = Path(sys.prefix) / "share" / "gpulab" / "kubernetes-json-schema"
#: a current Kubernetes release validated besides the dev cluster's and kubernetes-validate's newest
CURRENT_VERSION = "1.31"
#: the oldest release Chart.yaml's kubeVersion admits: validated too, so the claim stays true
OLDEST_VERSION = "1.20"
RELEASE = "gpulab"
NAMESPACE = "gpulab"
#: Helm lint severities (helm_python.lint's messages)
WARNING = 2


class ChartError(Exception):
    """The chart cannot be checked (a schema folder is missing, the Helm engine refused)."""


def dev_cluster_version() -> str:
    """The dev cluster's Kubernetes version, major.minor (gpulab.devcluster.build.KUBE_VERSION)."""
    from gpulab.devcluster.build import KUBE_VERSION

    return ".".join(KUBE_VERSION.split(".")[:2])


def validated_versions() -> list[str]:
    """The dev cluster's version, the oldest the chart admits, a current one and
    kubernetes-validate's newest."""
    import kubernetes_validate

    newest = ".".join(kubernetes_validate.latest_version().split(".")[:2])
    versions = {dev_cluster_version(), OLDEST_VERSION, CURRENT_VERSION, newest}
    return sorted(versions, key=_version_key)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def lint_values() -> dict[str, Any]:
    return dict(yaml.safe_load(LINT_VALUES.read_text()))


def lint(values: dict[str, Any] | None, kube_version: str) -> dict[str, Any]:
    """helm lint --strict of the chart with `values` for Kubernetes `kube_version` (x.y)."""
    import helm_python

    return dict(
        helm_python.lint(
            str(CHART),
            values or {},
            strict=True,
            namespace=NAMESPACE,
            kube_version=f"v{kube_version}.0",
        )
    )


def lint_problems(report: dict[str, Any]) -> list[str]:
    """Warnings and errors of a lint report (its info lines, e.g. "icon is recommended", are not)."""
    return [
        f"{m['path']}: {m['error'].strip()}"
        for m in report.get("messages", [])
        if int(m.get("severity", 0)) >= WARNING
    ]


def render(
    values: dict[str, Any] | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """The chart's templates rendered offline (no cluster: `lookup` finds nothing), by path."""
    from helm_python import Chart

    chart = Chart.load(str(CHART))
    try:
        return dict(chart.render(values or {}, name=name, namespace=namespace))
    finally:
        chart.close()


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping of a rendered template names a key twice (YAML loaders keep the last one; the
    API server too, so the first is lost without a word: a template bug yamllint would report)."""


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render, in template order; DuplicateKey for a mapping that
    names a key twice."""
    out = []
    for path in sorted(rendered):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.load_all(rendered[path], Loader=_StrictLoader):  # a SafeLoader
            if doc:
                out.append(doc)
    return out


def _schema_folder(version: str) -> Path | None:
    """Where the strict schemas of `version` are when kubernetes-validate lacks them."""
    from kubernetes_validate.utils import all_versions

    oldest = min((".".join(v.split(".")[:2]) for v in all_versions()), key=_version_key)
    if _version_key(version) >= _version_key(oldest):
        return None
    folder = OLD_SCHEMAS / f"v{version}.0-local-strict"
    if not (folder / "_definitions.json").exists():
        raise ChartError(
            f"no Kubernetes {version} schemas in {folder} (kubernetes-validate's own start at "
            f"{oldest}): run `bash .ci/dev setup`, which unpacks them from kubernetes-validate 1.28.0"
        )
    return folder


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
#: custom resources the chart renders, with the schemas of their CRDs (Kubernetes' own documents
#: do not have them; the API server prunes fields a structural schema lacks, so they are strict
#: here): VolumeSnapshotClass as external-snapshotter's v1 CRD defines it (v4 and later, which
#: serve v1 from Kubernetes 1.20 on)
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "driver", "deletionPolicy"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "labels": _STRING_MAP,
                    "annotations": _STRING_MAP,
                },
            },
            "driver": {"type": "string", "minLength": 1},
            "deletionPolicy": {"enum": ["Delete", "Retain"]},
            "parameters": _STRING_MAP,
        },
    },
}


class NoSchema(Exception):
    """No schema for a kind (custom resources: the API server knows them from their CRDs)."""


def _validate_with_folder(manifest: dict[str, Any], folder: Path) -> None:
    """kubernetes_validate.validate's procedure, with the schemas of `folder` (draft 4, as the
    OpenAPI v2 documents they were made from; their `$schema` names no draft)."""
    import re

    import jsonschema
    from referencing import Registry
    from referencing.jsonschema import DRAFT4

    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", manifest["apiVersion"])
    path = folder / f"{manifest['kind'].lower()}-{api}.json"
    if not path.exists():
        raise NoSchema(f"{manifest['kind']} {manifest['apiVersion']}")
    schema = json.loads(path.read_text())
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry: Registry[Any] = Registry().with_resources(
        [
            (path.name, DRAFT4.create_resource(schema)),
            ("_definitions.json", DRAFT4.create_resource(definitions)),
        ]
    )
    jsonschema.validators.Draft4Validator(schema, registry=registry).validate(manifest)


def validate(manifest: dict[str, Any], version: str) -> None:
    """Validate one object against Kubernetes `version`'s API schema, strictly (unknown fields
    are errors), a custom resource against its CRD's (CRD_SCHEMAS). Raises NoSchema for a kind
    neither knows and jsonschema.ValidationError for an invalid object."""
    import jsonschema
    import kubernetes_validate

    crd = CRD_SCHEMAS.get((manifest.get("apiVersion", ""), manifest.get("kind", "")))
    if crd is not None:
        jsonschema.validators.Draft7Validator(crd).validate(manifest)
        return
    folder = _schema_folder(version)
    if folder is not None:
        _validate_with_folder(manifest, folder)
        return
    try:
        kubernetes_validate.validate(manifest, f"{version}.0", strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        raise NoSchema(f"{manifest['kind']} {manifest['apiVersion']}") from e


def schema_errors(objects: Iterable[dict[str, Any]], version: str) -> tuple[list[str], list[str]]:
    """(errors, kinds without a schema) of `objects` for Kubernetes `version`."""
    import jsonschema

    errors, unvalidated = [], []
    for obj in objects:
        where = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        try:
            validate(obj, version)
        except NoSchema as e:
            unvalidated.append(f"{where} ({e})")
        except jsonschema.ValidationError as e:
            at = "/".join(str(p) for p in e.absolute_path) or "(object)"
            errors.append(f"{version} {where} at {at}: {e.message}")
    return errors, unvalidated


def install_tool() -> Any:
    """helm/tools/install.py (a script beside this one, loaded by path as tests/helm does)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpulab_chart_install", Path(__file__).with_name("install.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_figures(out: Any = sys.stderr) -> dict[str, Any]:
    """install_ready_s and spawn_ok on a fresh dev cluster; nan and 0 where none can run."""
    tool = install_tool()
    why = tool.can_run_dev_cluster()
    if why:
        print(f"install not measured: {why}", file=out)
        return {"install_ready_s": float("nan"), "spawn_ok": 0}
    return {**tool.measure(out), "install_attempted": True}


def measure(out: Any = sys.stderr, *, with_install: bool = True) -> dict[str, Any]:
    """Every check of this module, its findings written to `out`, its figures returned."""
    versions = validated_versions()
    warnings: list[str] = []
    errors: list[str] = []
    unvalidated: set[str] = set()
    for label, values in (("default values", None), ("ci/lint-values.yaml", lint_values())):
        for version in versions:
            for problem in lint_problems(lint(values, version)):
                warnings.append(f"lint ({label}, {version}): {problem}")
        objects = manifests(render(values))
        print(f"{label}: {len(objects)} objects rendered", file=out)
        for version in versions:
            found, missing = schema_errors(objects, version)
            errors += [f"({label}) {e}" for e in found]
            unvalidated.update(missing)
    for line in warnings + errors:
        print(line, file=out)
    for kind in sorted(unvalidated):
        print(f"not validated (no schema for its kind): {kind}", file=out)
    figures: dict[str, Any] = {
        "lint_warnings": len(warnings),
        "schema_errors": len(errors),
        "validated_versions": versions,
        "install_ready_s": float("nan"),
        "spawn_ok": 0,
    }
    figures["install_attempted"] = False
    if with_install:
        figures.update(install_figures(out))
    else:
        print("install not measured: --no-install", file=out)
    return figures


def summary_line(figures: dict[str, Any]) -> str:
    return (
        f"lint_warnings={figures['lint_warnings']} schema_errors={figures['schema_errors']} "
        f"validated_versions={','.join(figures['validated_versions'])} "
        f"install_ready_s={figures['install_ready_s']} spawn_ok={figures['spawn_ok']}"
    )


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--no-install", action="store_true", help="the checks without a cluster only"
    )
    args = parser.parse_args()
    try:
        figures = measure(with_install=not args.no_install)
    except ChartError as e:
        print(f"chart check: {e}", file=sys.stderr)
        return 2
    print(summary_line(figures))
    failed_install = figures["install_attempted"] and not figures["spawn_ok"]
    return 1 if figures["lint_warnings"] or figures["schema_errors"] or failed_install else 0


if __name__ == "__main__":
    sys.exit(main())
