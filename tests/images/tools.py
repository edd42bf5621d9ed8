"""images/tools/requirements.py, a script as helm/tools/check.py is, loaded by path for the
image checks (tests/images)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def requirements_tool() -> ModuleType:
    path = REPO / "images" / "tools" / "requirements.py"
    spec = importlib.util.spec_from_file_location("gpulab_images_requirements", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module
