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

After a cluster test fails, the single-user pods it left behind are deleted before the next test
starts (`delete_leftover_pods`): a test that fails after its spawner started never reaches its
`spawner.stop()`, and several tests spawn the same pod (user "start" in `kube_another_ns`), so the
next one's `poll()` found that pod running and failed too (2026-12-07: two override-namespace
tests after one failed check). Only pods KubeSpawner made (they carry the label
`hub.jupyter.org/username`; the suite's hub and exec pods do not), only after a failed call, so no
outcome is changed but a second failure that only the first one caused; the pods deleted are
written into the failed test's junit record (property `leftover_pods_deleted`) and the runner's
table names them.

Only this plugin's folder is put on the suite's PYTHONPATH, so nothing else of gpulab's can
shadow a module of the suite's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

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


#: every pod KubeSpawner makes carries this label (its value the user's name); the suite's
#: session pods (hub, hub-ssl, kubespawner-test-exec) do not
LEFTOVER_SELECTOR = "hub.jupyter.org/username"
LEFTOVERS_PROPERTY = "leftover_pods_deleted"
_CALL_FAILED = pytest.StashKey[bool]()


def delete_leftover_pods(timeout: float = 60.0) -> list[str]:
    """Delete every pod KubeSpawner made, in every namespace of the run's private cluster, and
    wait until they are gone; their namespace/name."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    api = client.CoreV1Api(config.new_client_from_config())  # $KUBECONFIG, as the suite's
    try:
        pods = api.list_pod_for_all_namespaces(label_selector=LEFTOVER_SELECTOR).items
        for pod in pods:
            try:
                api.delete_namespaced_pod(
                    pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
                )
            except ApiException as e:
                if e.status != 404:
                    raise
        deadline = time.monotonic() + timeout
        while api.list_pod_for_all_namespaces(label_selector=LEFTOVER_SELECTOR).items:
            if time.monotonic() > deadline:
                raise TimeoutError(f"leftover pods not gone after {timeout:.0f} s")
            time.sleep(0.5)
        return [f"{pod.metadata.namespace}/{pod.metadata.name}" for pod in pods]
    finally:
        api.api_client.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.stash[_CALL_FAILED] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's own fixtures are torn down first
    if not item.stash.get(_CALL_FAILED, False):
        return
    if ("needs_cluster", "true") not in item.user_properties:
        return
    # before the teardown report is made, which carries user_properties into the junit record;
    # a failed clean-up is recorded, never raised (it would turn the failure into an error)
    try:
        deleted = delete_leftover_pods()
    except Exception as e:  # noqa: BLE001
        item.user_properties.append((LEFTOVERS_PROPERTY, f"clean-up failed: {e!r}"[:300]))
    else:
        if deleted:
            item.user_properties.append((LEFTOVERS_PROPERTY, ",".join(deleted)))
