"""values.schema.yaml follows z2jh's rules, values.schema.json is what it gives, and the schema
and values.yaml name the same keys (helm/tools/schema.py)."""

from __future__ import annotations

from types import ModuleType

import yaml


def test_every_key_has_a_description_and_every_object_refuses_unknown_keys(
    schema_tool: ModuleType,
) -> None:
    assert schema_tool.rule_violations(schema_tool.load_schema()) == []


def test_the_committed_json_is_what_the_yaml_gives(schema_tool: ModuleType) -> None:
    committed = schema_tool.SCHEMA_JSON.read_text()
    assert committed == schema_tool.render_json(schema_tool.load_schema()), (
        "helm/gpulab/values.schema.json is out of date: run .venv/bin/python helm/tools/schema.py"
    )


def test_values_and_schema_name_the_same_keys(schema_tool: ModuleType) -> None:
    values = yaml.safe_load(schema_tool.VALUES.read_text())
    assert schema_tool.agreement_problems(schema_tool.load_schema(), values) == []


def test_the_whole_check_passes(schema_tool: ModuleType) -> None:
    assert schema_tool.check() == []


# the checks themselves find what they are for


def test_the_rules_find_an_undocumented_key_and_an_open_object(schema_tool: ModuleType) -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "hub": {
                "type": "object",
                "description": "the hub",
                "properties": {"port": {"type": "integer"}},
            },
            "labels": {"type": "object", "description": "a map without a value schema"},
        },
    }
    assert schema_tool.rule_violations(schema) == [
        "hub: an object with properties needs additionalProperties: false",
        "hub.port: no description",
        "labels: a map needs additionalProperties with a schema of its values",
    ]


def test_agreement_finds_a_key_missing_on_either_side(schema_tool: ModuleType) -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "a": {"type": "string", "description": "a"},
            "b": {"type": "string", "description": "b"},
            "users": {
                "type": "object",
                "description": "a map",
                "additionalProperties": {"type": "number"},
            },
        },
    }
    values = {"a": "x", "c": "y", "users": {"alice": 2}}
    assert schema_tool.agreement_problems(schema, values) == [
        "values.yaml: c is not in the schema",
        "values.schema.yaml: b has no default in values.yaml",
    ]
