"""values.schema.yaml -> values.schema.json of gpulab's chart, and the checks that keep the
schema, the json Helm reads and values.yaml in agreement (z2jh's tools/generate-json-schema.py and
its schema rules, written for this chart).

    .venv/bin/python helm/tools/schema.py           write helm/gpulab/values.schema.json
    .venv/bin/python helm/tools/schema.py --check   exit 1, saying why, when anything disagrees

The YAML is the source (comments, anchors for repeated shapes); the JSON is what Helm validates
values against on install, upgrade, lint and template, so it is committed, and tests/helm checks
that it is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "gpulab"
SCHEMA_YAML = CHART / "values.schema.yaml"
SCHEMA_JSON = CHART / "values.schema.json"
VALUES = CHART / "values.yaml"


def load_schema(path: Path = SCHEMA_YAML) -> dict[str, Any]:
    """The schema with its YAML anchors expanded; `definitions` (only anchors' homes) dropped."""
    schema = yaml.safe_load(path.read_text())
    schema.pop("definitions", None)
    return dict(schema)


def render_json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def objects(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object schema in `schema` with its dotted path (array items as `path[]`, map
    values as `path.*`)."""
    if schema.get("type") == "object" or "properties" in schema:
        yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from objects(sub, f"{path}.{name}" if path else name)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        yield from objects(extra, f"{path}.*")
    items = schema.get("items")
    if isinstance(items, dict):
        yield from objects(items, f"{path}[]")


def rule_violations(schema: dict[str, Any]) -> list[str]:
    """z2jh's rules: a description on every key, and no object that takes keys it does not
    name. An object either names its keys (`properties` with `additionalProperties: false`) or
    is a map whose keys the admin chooses and whose values have a schema (`additionalProperties:
    <schema>`)."""
    problems = []
    for path, obj in objects(schema):
        where = path or "(top level)"
        extra = obj.get("additionalProperties")
        if "properties" in obj:
            if extra is not False:
                problems.append(
                    f"{where}: an object with properties needs additionalProperties: false"
                )
        elif not isinstance(extra, dict):
            problems.append(
                f"{where}: a map needs additionalProperties with a schema of its values"
            )
        for name, sub in (obj.get("properties") or {}).items():
            if not str(sub.get("description", "")).strip():
                problems.append(f"{path + '.' if path else ''}{name}: no description")
    return problems


def _leaves(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Paths of the keys the schema names, down to keys that are not objects with properties
    (items of arrays and values of maps are the admin's: values.yaml need not give examples)."""
    for name, sub in (schema.get("properties") or {}).items():
        here = (*path, name)
        if "properties" in sub:
            yield from _leaves(sub, here)
        else:
            yield here


def _value_paths(values: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, value in values.items():
        here = (*path, str(name))
        if isinstance(value, dict) and value:
            yield from _value_paths(value, here)
        else:
            yield here


def _is_map(schema: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether `path` lies inside a map of the schema (keys the admin chooses)."""
    node: Any = schema
    for name in path:
        props = node.get("properties") or {}
        if name not in props:
            return isinstance(node.get("additionalProperties"), dict)
        node = props[name]
    return False


def agreement_problems(schema: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """values.yaml and the schema name the same keys: every key of values.yaml is in the schema,
    every key the schema names has a default in values.yaml (no schema leaf is optional)."""
    problems = []
    leaves = {".".join(p) for p in _leaves(schema)}
    given = set()
    for path in _value_paths(values):
        dotted = ".".join(path)
        given.add(dotted)
        if _is_map(schema, path):
            continue
        if dotted not in leaves and not any(dotted.startswith(leaf + ".") for leaf in leaves):
            problems.append(f"values.yaml: {dotted} is not in the schema")
    for leaf in sorted(leaves):
        if leaf not in given and not any(g.startswith(leaf + ".") for g in given):
            problems.append(f"values.schema.yaml: {leaf} has no default in values.yaml")
    return problems


def check() -> list[str]:
    """Everything that disagrees, as readable lines; empty when all agrees."""
    schema = load_schema()
    problems = rule_violations(schema)
    problems += agreement_problems(schema, yaml.safe_load(VALUES.read_text()))
    committed = SCHEMA_JSON.read_text() if SCHEMA_JSON.exists() else ""
    if committed != render_json(schema):
        problems.append(
            f"{SCHEMA_JSON.relative_to(CHART.parents[1])} is not what values.schema.yaml gives: "
            "run .venv/bin/python helm/tools/schema.py"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check, write nothing")
    args = parser.parse_args(argv)
    if not args.check:
        SCHEMA_JSON.write_text(render_json(load_schema()))
    problems = check()
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
