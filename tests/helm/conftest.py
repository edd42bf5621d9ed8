"""The chart's tools (helm/tools/check.py, helm/tools/schema.py) are scripts, as
docs/generate_config_reference.py is: loaded here by path, and the chart rendered once per
session with its default values and with ci/lint-values.yaml (every option on)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "helm" / "tools"


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpulab_chart_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def check() -> ModuleType:
    return load_tool("check")


@pytest.fixture(scope="session")
def schema_tool() -> ModuleType:
    return load_tool("schema")


@pytest.fixture(scope="session")
def lint_values(check: ModuleType) -> dict[str, Any]:
    return dict(check.lint_values())


@pytest.fixture(scope="session")
def default_objects(check: ModuleType) -> list[dict[str, Any]]:
    return list(check.manifests(check.render()))


@pytest.fixture(scope="session")
def all_options_objects(check: ModuleType, lint_values: dict[str, Any]) -> list[dict[str, Any]]:
    return list(check.manifests(check.render(lint_values)))


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The objects of `kind` (named `name`, when given)."""
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
