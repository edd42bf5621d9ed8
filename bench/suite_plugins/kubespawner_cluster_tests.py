"""A pytest plugin that bench.kubespawner_suite loads into KubeSpawner's own suite (`-p`), so the
suite's files stay as published.

A test "needs a cluster" when its fixture closure holds `kube_client`: the suite's session fixture
that loads the kubeconfig, lists namespaces (skipping the test when that fails) and creates
`kube_ns`/`kube_another_ns`; every other fixture that touches Kubernetes (`hub_pod`, `hub`,
`hub_pod_ssl`, `exec_python`, `exec_python_pod`) requests it. `kube_ns` alone is no such sign: it is
a namespace name that the plain `config` fixture reads too. The mark is written into each test's
junit xml record as the property `needs_cluster` (true/false), beside the fixtures that made it
so, and the runner reads it from there. Checked on 7.1.0 (2026-12-04): with a kubeconfig naming
no reachable server exactly the 20 tests marked here skip ("Kubernetes not found"), and the 187
others end as they do with a cluster (186 passed, test_variable_expansion's harness error).

Only this plugin's folder is put on the suite's PYTHONPATH, so nothing else of gpulab's can
shadow a module of the suite's.
"""

from __future__ import annotations

import pytest

#: the suite's fixtures that reach the cluster; all of them request kube_client
CLUSTER_FIXTURES = ("kube_client",)
#: recorded beside the verdict, to say which cluster pieces a test used
CLUSTER_FIXTURE_FAMILY = (
    "kube_client",
    "hub_pod",
    "hub",
    "hub_pod_ssl",
    "hub_ssl",
    "exec_python",
    "exec_python_pod",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        needs = any(name in fixtures for name in CLUSTER_FIXTURES)
        used = [name for name in CLUSTER_FIXTURE_FAMILY if name in fixtures]
        # user_properties reach every report of the item, and junitxml writes them as
        # <property> elements of its testcase
        item.user_properties.append(("needs_cluster", "true" if needs else "false"))
        if used:
            item.user_properties.append(("cluster_fixtures", ",".join(used)))
