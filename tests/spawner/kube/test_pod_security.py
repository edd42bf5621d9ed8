"""Every pod spec gpulab builds for a user namespace passes Pod Security `restricted` (the rules of
tests/harness/pod_security.py, which the dev-cluster test checks against the API server): a
server's, its admin-added init, sidecar and extra containers included, a job's, a Dask
scheduler's and worker's, a warm pool member's; the namespace labels the chart's hook sets; and
the settings that break `restricted` still build the pods they did."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jupyterhub.objects import Hub, Server
from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from kubespawner.objects import make_pod
from tornado import web

from gpulab.hub.allocator import GpuShare, Placement
from gpulab.hub.dask.allocations import scheduler_request
from gpulab.spawner.kube import GPUKubeSpawner
from gpulab.spawner.kube.dask_objects import dask_cluster_manifest, dask_worker_group_manifest
from gpulab.spawner.kube.dask_settings import KubeDaskSettings
from gpulab.spawner.kube.pod_security import (
    harden_security_context,
    main,
    namespace_label_patch,
    pod_security_labels,
    pod_security_refusal,
)
from tests.harness.pod_security import restricted_violations
from tests.spawner.kube.test_job_objects import (
    QUARTER,
    manifest,
    placed,
    placement_of,
    whole_gpu_job,
)
from tests.spawner.kube.test_warm_member_pod import member_manifest, member_placement

#: what KubeSpawner makes of GPUKubeSpawner's defaults for the server container
SERVER_HARDENING = {
    "runAsUser": 1000,
    "runAsGroup": 100,
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
    "capabilities": {"drop": ["ALL"]},
}
#: containers an admin adds as KubeSpawner's docs show them: no securityContext of their own
ADMIN_INIT = {"name": "fetch-data", "image": "busybox", "command": ["true"]}
ADMIN_SIDECAR = {"name": "log-shipper", "image": "fluent-bit", "restartPolicy": "Always"}
ADMIN_EXTRA = {"name": "tensorboard", "image": "tensorboard", "args": ["--logdir", "/home"]}
MIG_QUARTER = (GpuShare("MIG-aaaa", 250),)


def spawner(**config: Any) -> GPUKubeSpawner:
    user = type("User", (), {})()
    user.name = user.escaped_name = "alice"
    user.id, user.url, user.server, user.settings = 1, "/user/alice/", Server(), {}
    made = GPUKubeSpawner(_mock=True, user=user, hub=Hub(), namespace="lab", **config)
    made.api_token = "unused"
    return made


async def server_pod(made: GPUKubeSpawner, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The server pod's spec as the spawner sends it (its Secret and NetworkPolicy calls off)."""

    async def nothing() -> None:
        return None

    monkeypatch.setattr(made, "ensure_checkpoint_key_secret", nothing)
    monkeypatch.setattr(made, "ensure_network_policy", nothing)
    pod = await made.get_pod_manifest()
    body: dict[str, Any] = made.api.api_client.sanitize_for_serialization(pod)
    return dict(body["spec"])


# -- what gpulab builds ----------------------------------------------------------------------


async def test_a_servers_pod_passes_restricted_with_the_containers_an_admin_adds(
    offline_kube_config: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = spawner(
        init_containers=[ADMIN_INIT, ADMIN_SIDECAR],
        extra_containers=[ADMIN_EXTRA],
        prestop_command=["python3", "-m", "gpulab.spawner.singleuser.prestop"],
    )
    spec = await server_pod(made, monkeypatch)
    assert restricted_violations(spec) == []
    assert spec["securityContext"] == {
        "fsGroup": 100,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    containers = {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}
    assert containers["notebook"]["securityContext"] == SERVER_HARDENING
    for name in ("fetch-data", "log-shipper", "tensorboard"):
        assert containers[name]["securityContext"] == SERVER_HARDENING, name
    assert containers["log-shipper"]["restartPolicy"] == "Always"  # still a native sidecar


async def test_an_admin_container_unhardened_is_what_restricted_would_refuse(
    offline_kube_config: None,
) -> None:
    # KubeSpawner's own make_pod hardens the notebook container alone: why the spawner fills in
    # the others (the test above)
    pod = make_pod(
        "p",
        cmd=["jupyterhub-singleuser"],
        port=8888,
        image="img",
        init_containers=[ADMIN_INIT],
        extra_containers=[ADMIN_EXTRA],
        container_security_context=SERVER_HARDENING,
        pod_security_context={"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    )
    spec = spawner().api.api_client.sanitize_for_serialization(pod)["spec"]
    assert restricted_violations(spec) == [
        "containers 'tensorboard': allowPrivilegeEscalation is not false",
        "containers 'tensorboard': capabilities do not drop ALL",
        "initContainers 'fetch-data': allowPrivilegeEscalation is not false",
        "initContainers 'fetch-data': capabilities do not drop ALL",
    ]


def test_a_jobs_pod_passes_restricted() -> None:
    assert restricted_violations(whole_gpu_job()["spec"]["template"]["spec"]) == []
    quarter = manifest(QUARTER, None, MIG_QUARTER)
    assert restricted_violations(quarter["spec"]["template"]["spec"]) == []


def test_a_dask_clusters_scheduler_and_worker_pods_pass_restricted() -> None:
    settings = KubeDaskSettings(namespace="lab", image="img")
    scheduler = Placement(
        request=scheduler_request(
            "alice", frozenset(), 7, cpu_milli=500, memory_mib=1024, affinity_group=None
        ),
        node="n1",
        gpus=(),
        created_at=0.0,
    )
    cluster = dask_cluster_manifest("alice", 7, placement=scheduler, settings=settings)
    assert restricted_violations(cluster["spec"]["scheduler"]["spec"]) == []
    # the operator's default worker group (0 replicas, never run) would pass too
    assert restricted_violations(cluster["spec"]["worker"]["spec"]) == []
    placement = placement_of(QUARTER, MIG_QUARTER)
    worker = dask_worker_group_manifest(
        "alice",
        7,
        1,
        placement=placement,
        pod=placed(QUARTER, placement, None),
        scheduler_address="tls://gpulab-dask-alice-7-scheduler:8786",
        cpu_milli=1000,
        memory_mib=4096,
        settings=settings,
    )
    assert restricted_violations(worker["spec"]["worker"]["spec"]) == []


def test_a_warm_members_pod_and_its_pulling_init_container_pass_restricted() -> None:
    spec = member_manifest(member_placement())["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["pull"]
    assert restricted_violations(spec) == []


# -- settings that break `restricted`: they still build their pods (for other namespaces) -------


async def test_run_as_non_root_off_builds_a_pod_restricted_would_refuse(
    offline_kube_config: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = spawner(run_as_non_root=False, uid=0, seccomp_profile="Unconfined")
    spec = await server_pod(made, monkeypatch)
    assert spec["containers"][0]["securityContext"]["runAsUser"] == 0
    assert restricted_violations(spec) == [
        "pod: seccompProfile Unconfined",
        "containers 'notebook': runAsNonRoot is not true",
        "containers 'notebook': runAsUser 0",
        "containers 'notebook': seccompProfile Unconfined",
    ]


@pytest.mark.parametrize("trait", ["run_as_non_root", "seccomp_profile", "drop_capabilities"])
def test_the_options_that_break_restricted_say_so(trait: str) -> None:
    help_text = " ".join(GPUKubeSpawner.class_traits()[trait].help.split())
    assert "Pod Security `restricted`" in help_text and "not restricted" in help_text


# -- the hardening of an admin's container ----------------------------------------------------


def test_an_admins_own_settings_win_and_privileged_is_never_spread() -> None:
    hardening = {**SERVER_HARDENING, "privileged": True}
    own = {"runAsUser": 2000, "readOnlyRootFilesystem": True}
    assert harden_security_context(own, hardening) == {
        **SERVER_HARDENING,
        "runAsUser": 2000,
        "readOnlyRootFilesystem": True,
    }
    assert own == {"runAsUser": 2000, "readOnlyRootFilesystem": True}  # not changed in place


def test_no_default_contradicts_what_an_admins_container_asks_for() -> None:
    # uid 0 stays runnable where the namespace allows it (no runAsNonRoot beside it) ...
    as_root = harden_security_context({"runAsUser": 0}, SERVER_HARDENING)
    assert "runAsNonRoot" not in as_root and as_root["allowPrivilegeEscalation"] is False
    # ... the API server refuses allowPrivilegeEscalation=false beside privileged or SYS_ADMIN
    for own in (
        {"privileged": True},
        {"capabilities": {"add": ["SYS_ADMIN"]}},
    ):
        assert "allowPrivilegeEscalation" not in harden_security_context(own, SERVER_HARDENING)
    # its own capabilities are the whole of them
    net = {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}
    assert harden_security_context(net, SERVER_HARDENING)["capabilities"] == net["capabilities"]


# -- the namespace's labels (the chart's hook Job) --------------------------------------------


def test_the_namespace_labels_enforce_and_warn_at_one_level_and_version() -> None:
    assert pod_security_labels("restricted") == {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
        "pod-security.kubernetes.io/warn": "restricted",
        "pod-security.kubernetes.io/warn-version": "latest",
    }
    assert namespace_label_patch("baseline", "v1.37") == {
        "metadata": {"labels": pod_security_labels("baseline", "v1.37")}
    }


@pytest.mark.parametrize(
    ("level", "version", "named"),
    [("strict", "latest", "level 'strict'"), ("restricted", "1.37", "version '1.37'")],
)
def test_a_level_or_version_kubernetes_does_not_know_is_refused(
    level: str, version: str, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        pod_security_labels(level, version)


def test_the_command_line_refuses_a_bad_version_before_calling_a_cluster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["label-namespace", "lab", "--version", "next"])
    assert exited.value.code == 2 and "version 'next'" in capsys.readouterr().err


# -- a refused spawn says why ------------------------------------------------------------------

REFUSED = json.dumps(
    {
        "kind": "Status",
        "status": "Failure",
        "code": 403,
        "reason": "Forbidden",
        "message": 'pods "jupyter-pia" is forbidden: violates PodSecurity "restricted:latest": '
        'runAsNonRoot != true (pod or container "notebook" must set '
        "securityContext.runAsNonRoot=true)",
    }
)


def test_only_a_pod_security_refusal_is_read_as_one() -> None:
    assert pod_security_refusal(403, REFUSED).startswith('pods "jupyter-pia" is forbidden')
    quota = json.dumps({"message": 'pods "p" is forbidden: exceeded quota: compute'})
    assert pod_security_refusal(403, quota) is None
    assert pod_security_refusal(422, REFUSED) is None
    assert pod_security_refusal(403, "<html>proxy error</html>") is None
    assert pod_security_refusal(403, None) is None


async def test_a_spawn_the_namespace_refuses_fails_with_the_reason_and_the_options_to_look_at(
    offline_kube_config: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = spawner(run_as_non_root=False)
    released: list[bool] = []

    async def refused(self: Any) -> Any:
        error = ApiException(status=403, reason="Forbidden")
        error.body = REFUSED  # as the client fills it from the API server's answer
        raise error

    async def release() -> None:
        released.append(True)

    monkeypatch.setattr(KubeSpawner, "_start", refused)
    monkeypatch.setattr(made, "gpulab_release", release)
    with pytest.raises(web.HTTPError) as caught:
        await made._start()
    message = caught.value.log_message or ""
    assert 'violates PodSecurity "restricted:latest"' in message
    assert "namespace lab enforces Pod Security" in message
    assert "GPUKubeSpawner.run_as_non_root" in message
    assert released == [True]  # its GPU share is given back, as for any failed start
