"""The values example in README's "Install on a cluster" installs as written: the schema takes
it, the chart renders it with strict lint clean, and it makes what the README says it makes."""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import yaml

from tests.helm.conftest import REPO, find


def readme_values() -> dict[str, Any]:
    text = (REPO / "README.md").read_text()
    found = re.search(r"```yaml\n# gpulab-values\.yaml\n(.*?)```", text, re.S)
    assert found, "README's gpulab-values.yaml example is gone"
    return dict(yaml.safe_load(found.group(1)))


def test_the_readme_example_renders_lints_clean_and_makes_what_it_says(check: ModuleType) -> None:
    values = readme_values()
    objects = check.manifests(check.render(values))
    for version in check.validated_versions():
        assert check.lint_problems(check.lint(values, version)) == []
    placeholder = [
        d
        for d in find(objects, "Deployment")
        if d["metadata"]["labels"]["component"] == "gpu-placeholder"
    ]
    assert [p["spec"]["replicas"] for p in placeholder] == [1]
    assert find(objects, "Deployment", "gpulab-dask-operator")
    # the hub is configured with the example's profiles and quotas
    (configmap,) = find(objects, "ConfigMap", "gpulab-hub")
    traits = yaml.safe_load(configmap["data"]["gpulab-traits.yaml"])
    slugs = [p["slug"] for p in traits["GPUCapacity"]["profiles"]]
    assert slugs == ["cpu", "gpu-quarter", "gpu-1", "gpu-1-spot"]
