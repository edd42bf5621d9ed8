"""An unmodified KubeSpawner in a real JupyterHub spawns a single-user server on the agent, in its
namespace or in one a profile names."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.kube import CONNECT_SCRIPT, Kube, pod_manifest
from tests.harness.ports import free_port
from tests.harness.wait import wait_for

BIN = Path(sys.executable).parent

CONFIG = """
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
# where pods reach the host (127.0.0.1 would be the server pod's own loopback)
c.JupyterHub.hub_ip = "{hub_ip}"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_port}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.JupyterHub.db_url = "sqlite:///{state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{state}/cookie_secret"
c.JupyterHub.authenticator_class = "dummy"
c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.JupyterHub.services = [{{"name": "kube-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [
    {{"name": "kube-test", "scopes": ["admin:users", "admin:servers"], "services": ["kube-test"]}}
]
c.KubeSpawner.namespace = "default"
c.KubeSpawner.image = "quay.io/jupyter/base-notebook:latest"  # not pulled: the agent runs cmd
c.KubeSpawner.cmd = ["jupyterhub-singleuser"]  # found on the agent's PATH
c.KubeSpawner.extra_resource_limits = {{"nvidia.com/gpu": "1"}}
c.KubeSpawner.node_selector = {{"kubernetes.io/hostname": "gpu-a"}}
c.KubeSpawner.storage_pvc_ensure = True
c.KubeSpawner.storage_class = "gpulab-local"
c.KubeSpawner.storage_capacity = "1Gi"
c.KubeSpawner.pvc_name_template = "claim-{{username}}"
c.KubeSpawner.volumes = [{{"name": "home", "persistentVolumeClaim": {{"claimName": "claim-kubeuser"}}}}]
c.KubeSpawner.volume_mounts = [{{"name": "home", "mountPath": "/home/jovyan"}}]
c.KubeSpawner.working_dir = "/home/jovyan"
c.KubeSpawner.start_timeout = 120
c.KubeSpawner.http_timeout = 90
"""

#: KubeSpawner's own suite's scenario (test_spawn_start_profile_callback_override_namespace): a
#: profile_list callable whose second profile moves the server to another namespace, with one
#: reflector for all namespaces (enable_user_namespaces)
PROFILE_NAMESPACE_CONFIG = """
c.KubeSpawner.enable_user_namespaces = True
c.KubeSpawner.user_namespace_template = "default"
c.KubeSpawner.volumes = []
c.KubeSpawner.volume_mounts = []
c.KubeSpawner.storage_pvc_ensure = False
c.KubeSpawner.extra_resource_limits = {{}}
c.KubeSpawner.node_selector = {{}}

def _profiles(spawner):
    return [
        {{"display_name": "Default namespace", "slug": "default-namespace", "default": True,
          "kubespawner_override": {{"cpu_limit": 1}}}},
        {{"display_name": "Different namespace", "slug": "different-namespace",
          "kubespawner_override": {{"namespace": {namespace!r}, "cpu_limit": 1}}}},
    ]

c.KubeSpawner.profile_list = _profiles
"""


@contextlib.contextmanager
def _running_hub(tmp_path: Path, dev_cluster, extra: str = "") -> Iterator[Callable[..., dict]]:
    """A JupyterHub with an unmodified KubeSpawner (CONFIG, then `extra`); yields a REST caller
    with an admin service token."""
    state = tmp_path / "hub"
    state.mkdir()
    token = secrets.token_hex(16)
    port = free_port()
    config = state / "jupyterhub_config.py"
    config.write_text(
        CONFIG.format(
            port=port,
            hub_port=free_port(),
            hub_ip=dev_cluster.host_address,
            proxy_port=free_port(),
            chp=str(BIN / "configurable-http-proxy"),
            state=state,
            token=token,
        )
        + extra
    )
    env = dict(os.environ, KUBECONFIG=str(dev_cluster.kubeconfig))
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    log = (state / "hub.log").open("wb")
    proc = subprocess.Popen(
        [str(BIN / "jupyterhub"), "-f", str(config)],
        cwd=state,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/hub/api"

    def call(method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(
            url + path,
            method=method,
            headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
            data=None if body is None else json.dumps(body).encode(),
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = r.read()
        return json.loads(answer) if answer else {}

    def up() -> bool:
        try:
            return "version" in call("GET", "/")
        except (OSError, urllib.error.URLError):
            assert proc.poll() is None, (state / "hub.log").read_text()[-3000:]
            return False

    try:
        wait_for("JupyterHub to answer", up, 60)
        yield call
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def hub(tmp_path: Path, dev_cluster):
    with _running_hub(tmp_path, dev_cluster) as call:
        yield call


def test_unmodified_kubespawner_spawns_a_gpu_server_with_a_home_volume_and_stops_it(
    hub, kube: Kube
) -> None:
    kube.pvcs.append("claim-kubeuser")
    hub("POST", "/users/kubeuser")
    t0 = time.monotonic()
    hub("POST", "/users/kubeuser/server")  # waits up to JupyterHub's slow_spawn_timeout (10 s)

    def ready() -> bool:
        server = hub("GET", "/users/kubeuser").get("servers", {}).get("", {})
        return bool(server.get("ready"))

    wait_for("the single-user server to be ready", ready, 150, interval=0.5)
    print(f"KubeSpawner: spawn to ready in {time.monotonic() - t0:.1f} s")
    pod = kube.pod("jupyter-kubeuser")
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert pod["spec"]["nodeName"] == "gpu-a"
    pod_cidr = ipaddress.ip_network(kube.node("gpu-a")["spec"]["podCIDR"])
    assert ipaddress.ip_address(pod["status"]["podIP"]) in pod_cidr
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pvc = kube.api("GET", "/api/v1/namespaces/default/persistentvolumeclaims/claim-kubeuser")
    assert pvc["status"]["phase"] == "Bound"
    hub("DELETE", "/users/kubeuser/server")
    kube.wait_gone("jupyter-kubeuser", timeout=90)


def test_a_profile_callback_moves_the_server_to_a_namespace_made_after_the_cluster_started(
    tmp_path: Path, dev_cluster
) -> None:
    # made now, long after the node agent started, as the suite's kubespawner-another is; with
    # the suite runner's policy in it (only the cluster's pod network, this machine included, in)
    from bench.kubespawner_suite import machine_only_policy

    namespace = f"ks-another-{uuid.uuid4().hex[:6]}"
    dev_cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    try:
        dev_cluster.api(
            "POST",
            f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
            machine_only_policy(dev_cluster.pod_network),
        )
        extra = PROFILE_NAMESPACE_CONFIG.format(namespace=namespace)
        with _running_hub(tmp_path, dev_cluster, extra) as hub:
            hub("POST", "/users/start")
            hub("POST", "/users/start/server", {"profile": "different-namespace"})

            def server() -> dict:
                return hub("GET", "/users/start").get("servers", {}).get("", {})

            # ready: the hub's own HTTP check reached the server in the other namespace
            wait_for(
                "the server in the profile's namespace to be ready",
                lambda: server().get("ready"),
                150,
                interval=0.5,
            )
            kube = Kube(dev_cluster, namespace)
            pod = kube.pod("jupyter-start")
            assert pod is not None and pod["status"]["phase"] == "Running"
            # and a pod of the hub's namespace reaches it, as the suite's exec pod does
            target = f"{pod['status']['podIP']}:8888"
            client = Kube(dev_cluster)
            name = client.name("client")
            client.create_pod(pod_manifest(name, [sys.executable, "-c", CONNECT_SCRIPT, target]))
            try:
                assert client.wait_phase(name, "Succeeded")
                seen = json.loads(dev_cluster.logs(name).strip().splitlines()[-1])
                assert seen == {target: "open"}
            finally:
                client.close()
            hub("DELETE", "/users/start/server")
            kube.wait_gone("jupyter-start", timeout=90)
    finally:
        dev_cluster.api("DELETE", f"/api/v1/namespaces/{namespace}")
