"""The committed configuration reference (docs/configuration.md) is what the traitlets say now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "docs" / "generate_config_reference.py"


def test_configuration_reference_matches_the_traitlets() -> None:
    spec = importlib.util.spec_from_file_location("generate_config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)

    committed = (REPO / "docs" / "configuration.md").read_text()

    assert committed == generator.render(), (
        "docs/configuration.md is out of date: run "
        ".venv/bin/python docs/generate_config_reference.py"
    )
