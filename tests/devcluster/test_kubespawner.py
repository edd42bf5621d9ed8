"""An unmodified KubeSpawner in a real JupyterHub spawns a single-user server on the agent."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.harness.kube import Kube
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


@pytest.fixture
def hub(tmp_path: Path, dev_cluster):
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

    def call(method: str, path: str) -> dict:
        req = urllib.request.Request(
            url + path, method=method, headers={"Authorization": f"token {token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else {}

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
