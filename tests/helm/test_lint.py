"""helm lint --strict through the Helm engine of PyPI's helm-python-sdk: no warning and no error
with the default values and with every option on, for the dev cluster's Kubernetes and current
ones and the oldest it admits; and Chart.yaml's kubeVersion admits the dev cluster's."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.helm.conftest import load_tool

VERSIONS = load_tool("check").validated_versions()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values_name", ["default", "all options"])
def test_strict_lint_finds_nothing(
    check: ModuleType, lint_values: dict[str, Any], values_name: str, version: str
) -> None:
    values = None if values_name == "default" else lint_values
    report = check.lint(values, version)
    assert report["errors"] == []
    assert check.lint_problems(report) == []


def test_the_dev_clusters_version_is_among_those_checked(check: ModuleType) -> None:
    from gpulab.devcluster.build import KUBE_VERSION

    assert check.dev_cluster_version() == ".".join(KUBE_VERSION.split(".")[:2])
    assert check.dev_cluster_version() in VERSIONS
    assert "1.20" in VERSIONS  # the oldest Chart.yaml's kubeVersion admits
    assert any(tuple(map(int, v.split("."))) >= (1, 31) for v in VERSIONS)


def test_kube_version_admits_the_dev_cluster(check: ModuleType) -> None:
    """Helm refuses to install on a cluster outside Chart.yaml's kubeVersion (helm lint does
    not compare it with --kube-version, so the constraint is read here): from 1.20 on, with
    pre-releases (the `-0`, Helm's idiom for providers' x.y.z-eks builds)."""
    from gpulab.devcluster.build import KUBE_VERSION

    chart = yaml.safe_load((check.CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.20.0-0"
    assert tuple(map(int, KUBE_VERSION.split("."))) >= (1, 20, 0)
