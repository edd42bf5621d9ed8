"""The names admins put in their configs keep working across the layout change (issue 13).

Entry points (``gpulab-simple``, ``gpulab-local``, ``gpulab-kube``), the dotted class paths of the
spawners and the authenticator, and ``python -m gpulab.hub.metrics_service`` are what existing
``jupyterhub_config.py`` files and service definitions name; each must still load the same class
or program as its new home.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

SPAWNER_ENTRY_POINTS = {
    "gpulab-simple": "gpulab.spawner.local.spawner.GPUSimpleLocalSpawner",
    "gpulab-local": "gpulab.spawner.local.spawner.GPULocalSpawner",
    "gpulab-kube": "gpulab.spawner.kube.spawner.GPUKubeSpawner",
}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@pytest.mark.parametrize("name", sorted(SPAWNER_ENTRY_POINTS))
def test_spawner_entry_point_loads_the_spawner(name: str) -> None:
    (ep,) = [ep for ep in entry_points(group="jupyterhub.spawners") if ep.name == name]
    assert _qualified(ep.load()) == SPAWNER_ENTRY_POINTS[name]


@pytest.mark.parametrize(
    ("configured", "home"),
    [
        ("gpulab.spawner.local.GPUSimpleLocalSpawner", SPAWNER_ENTRY_POINTS["gpulab-simple"]),
        ("gpulab.spawner.local.GPULocalSpawner", SPAWNER_ENTRY_POINTS["gpulab-local"]),
        ("gpulab.spawner.kube.GPUKubeSpawner", SPAWNER_ENTRY_POINTS["gpulab-kube"]),
        ("gpulab.hub.auth.GPULabAuthenticator", "gpulab.hub.auth.GPULabAuthenticator"),
    ],
)
def test_dotted_class_paths_in_existing_configs_still_import(configured: str, home: str) -> None:
    module, _, attribute = configured.rpartition(".")
    assert _qualified(getattr(importlib.import_module(module), attribute)) == home


def test_the_kube_package_imports_without_loading_kubespawner() -> None:
    """The pure Kubernetes modules (manifests, GPU resources) are used by the hub and tests
    without the `kube` extra's clients: importing the package must not import KubeSpawner."""
    code = (
        "import sys, gpulab.spawner.kube; "
        "print('kubespawner' in sys.modules, 'kubernetes_asyncio' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("module", ["gpulab.hub.metrics_service", "gpulab.hub.services.metrics"])
def test_metrics_service_runs_under_its_old_and_new_module_names(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "gpulab-metrics" in out.stdout
