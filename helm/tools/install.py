"""gpulab's chart on a real API server: server-side dry run, install, a GPU spawn through the
installed hub, upgrade and uninstall, against the dev cluster (gpulab.devcluster).

    .venv/bin/python helm/tools/install.py      (root: starts a fresh dev cluster, then stops it)

prints `install_ready_s=<x> spawn_ok=<0|1>`; helm/tools/check.py puts the same figures on its last
line and tests/helm/test_install.py asserts the steps one by one.

The install goes through the Helm engine of PyPI's helm-python-sdk (Helm 4, server-side apply)
with the dev cluster's kubeconfig, as `helm install` would. The dev cluster runs no images: its
node agent runs each container's command from this machine's environment (the venv's bin/ is on
its PATH, so `jupyterhub` and `configurable-http-proxy` are found) and a pause image's container
as a pause process (GPU placeholders).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

CHART = Path(__file__).resolve().parents[1] / "gpulab"
RELEASE = "gpulab"
NAMESPACE = "gpulab"
#: the hub service whose API token the checks use (an admin's script would hold such a token)
CHECK_SERVICE = "install-check"
#: the GPU profile spawned through the installed hub (the chart's default catalog: one whole GPU)
GPU_PROFILE = "gpu-1"
USER = "alice"
#: a fresh dev cluster's one node for `bash .ci/dev chart`: room for the placeholder and a server
NODE_GPUS = 8
#: seconds a step may take on a loaded two-core machine before it counts as failed
HUB_TIMEOUT = 180
SPAWN_TIMEOUT = 180

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# -- values ----------------------------------------------------------------------------------


def check_values(token: str, **extra: Any) -> dict[str, Any]:
    """Values for an install on the dev cluster: the proxy's public Service as a ClusterIP (the
    dev cluster has no load balancer; this machine routes to ClusterIPs), a GPU placeholder for
    GPU_PROFILE, and a hub service holding `token` with the scopes to create a user and start and
    reach their server (the hub's own authenticator stays in place)."""
    role = {
        "name": CHECK_SERVICE,
        "scopes": ["admin:users", "admin:servers", "access:servers"],
        "services": [CHECK_SERVICE],
    }
    service = {"name": CHECK_SERVICE, "api_token": token}
    code = (
        f"c.JupyterHub.services.append({json.dumps(service)})\n"
        f"c.JupyterHub.load_roles.append({json.dumps(role)})\n"
    )
    values: dict[str, Any] = {
        "proxy": {"service": {"type": "ClusterIP"}},
        "hub": {"extraConfig": {CHECK_SERVICE: code}},
        "placeholders": {"enabled": True, "profiles": {GPU_PROFILE: {"count": 1}}},
    }
    return _merge(values, extra)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def chart_copy(version: str, into: Path) -> Path:
    """The chart as a release `version` of it would be: a copy whose Chart.yaml says so (the
    upgrade checks go from the chart's version to a later one)."""
    target = into / "gpulab"
    shutil.copytree(CHART, target)
    meta = yaml.safe_load((target / "Chart.yaml").read_text())
    meta["version"] = version
    (target / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return target


def next_patch(version: str) -> str:
    major, minor, patch = version.split("-", 1)[0].split(".")
    return f"{major}.{minor}.{int(patch) + 1}"


def chart_version(path: Path = CHART) -> str:
    return str(yaml.safe_load((path / "Chart.yaml").read_text())["version"])


# -- the API server --------------------------------------------------------------------------


def _collection(cluster: Any, obj: dict[str, Any], namespace: str, cache: dict[str, Any]) -> str:
    """The REST collection of `obj`'s kind, from the API server's discovery."""
    api_version = obj["apiVersion"]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if base not in cache:
        cache[base] = cluster.api("GET", base)["resources"]
    (resource,) = [r for r in cache[base] if r["kind"] == obj["kind"] and "/" not in r["name"]]
    if resource["namespaced"]:
        ns = obj["metadata"].get("namespace") or namespace
        return f"{base}/namespaces/{ns}/{resource['name']}"
    return f"{base}/{resource['name']}"


def _error(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read()).get("message"))
    except ValueError:
        return str(e)


def server_dry_run(cluster: Any, objects: list[dict[str, Any]], namespace: str) -> list[str]:
    """Create every object with dryRun=All (admission, defaulting, validation and, for custom
    resources, their CRD's schema, but nothing stored); the API server's refusals, one line each.
    `namespace` must exist (the server checks it)."""
    cache: dict[str, Any] = {}
    errors = []
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            path = _collection(cluster, obj, namespace, cache)
            cluster.api("POST", f"{path}?dryRun=All", obj)
        except urllib.error.HTTPError as e:
            errors.append(f"{where}: {e.code} {_error(e)}")
        except ValueError:
            errors.append(f"{where}: the API server serves no {obj['apiVersion']} {obj['kind']}")
    return errors


def leftovers(cluster: Any, objects: list[dict[str, Any]], namespace: str) -> list[str]:
    """Which of `objects` still exist."""
    cache: dict[str, Any] = {}
    left = []
    for obj in objects:
        path = f"{_collection(cluster, obj, namespace, cache)}/{obj['metadata']['name']}"
        try:
            cluster.api("GET", path)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                continue
            raise
        left.append(f"{obj['kind']}/{obj['metadata']['name']}")
    return left


def release_records(cluster: Any, namespace: str = NAMESPACE, release: str = RELEASE) -> list[str]:
    """Helm's release records (Secrets of type helm.sh/release.v1) of `release`."""
    items = cluster.api(
        "GET", f"/api/v1/namespaces/{namespace}/secrets?labelSelector=owner%3Dhelm,name%3D{release}"
    )["items"]
    return [s["metadata"]["name"] for s in items]


def manifests_of(release: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects of a release (its rendered manifest, as Helm applied it)."""
    return [doc for doc in yaml.safe_load_all(release["manifest"]) if doc]


def hub_secret(cluster: Any, namespace: str = NAMESPACE) -> dict[str, str]:
    return dict(cluster.api("GET", f"/api/v1/namespaces/{namespace}/secrets/{RELEASE}-hub")["data"])


def pods(cluster: Any, selector: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    path = f"/api/v1/namespaces/{namespace}/pods?labelSelector={urllib.request.quote(selector)}"
    return list(cluster.api("GET", path)["items"])


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


# -- Helm --------------------------------------------------------------------------------------


@contextlib.contextmanager
def helm(cluster: Any, namespace: str = NAMESPACE) -> Iterator[Any]:
    """A Helm client of the dev cluster (its kubeconfig: cluster-admin)."""
    from helm_python import Config

    config = Config(kubeconfig_path=cluster.kubeconfig, namespace=namespace)
    try:
        yield config
    finally:
        config.close()


def install(
    helm_config: Any, chart: Path, values: dict[str, Any], namespace: str = NAMESPACE
) -> Any:
    """helm install RELEASE chart --namespace namespace --create-namespace (no --wait: the
    caller measures when the hub answers)."""
    from helm_python import Chart

    loaded = Chart.load(str(chart))
    try:
        return helm_config.install(
            loaded, RELEASE, values, namespace=namespace, create_namespace=True, timeout=120
        )
    finally:
        loaded.close()


def upgrade(
    helm_config: Any, chart: Path, values: dict[str, Any], namespace: str = NAMESPACE
) -> Any:
    from helm_python import Chart

    loaded = Chart.load(str(chart))
    try:
        return helm_config.upgrade(loaded, RELEASE, values, namespace=namespace, timeout=120)
    finally:
        loaded.close()


# -- the installed hub, as a user reaches it ---------------------------------------------------


class Hub:
    """The installed hub through the proxy's public Service (its ClusterIP, which this machine
    routes to, as a user's browser reaches a LoadBalancer's address), with a service token."""

    def __init__(self, cluster: Any, token: str, namespace: str = NAMESPACE) -> None:
        service = cluster.api(
            "GET", f"/api/v1/namespaces/{namespace}/services/{RELEASE}-proxy-public"
        )
        port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
        self.url = f"http://{service['spec']['clusterIP']}:{port}"
        self.token = token

    def request(self, method: str, path: str, body: Any = None, timeout: float = 10) -> Any:
        req = urllib.request.Request(
            f"{self.url}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
        return json.loads(data) if data else None

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self.request(method, f"/hub/api{path}", body)

    def answers(self) -> bool:
        """The hub's REST API answers through the proxy (GET /hub/api: its version)."""
        try:
            return "version" in self.api("GET", "")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def wait(self, timeout: float = HUB_TIMEOUT) -> None:
        wait_for(f"the hub at {self.url}/hub/api", self.answers, timeout)

    def server(self, user: str) -> dict[str, Any] | None:
        return (self.api("GET", f"/users/{user}").get("servers") or {}).get("")

    def spawn(self, user: str, profile: str, timeout: float = SPAWN_TIMEOUT) -> dict[str, Any]:
        """Create `user`, start their server with `profile` and wait until the hub says it is
        ready and it answers through the proxy; the hub's record of the server."""
        try:
            self.api("POST", f"/users/{user}")
        except urllib.error.HTTPError as e:
            if e.code != 409:  # an existing user keeps their record
                raise
        self.api("POST", f"/users/{user}/server", {"profile": profile})
        server = wait_for(
            f"{user}'s server to be ready",
            lambda: (s := self.server(user)) and s.get("ready") and s,
            timeout,
            every=1,
        )
        # the server itself, through the route the hub added to the proxy
        self.request("GET", f"/user/{user}/api/status")
        return dict(server)

    def stop(self, user: str, timeout: float = 120) -> None:
        try:
            self.api("DELETE", f"/users/{user}/server")
        except urllib.error.HTTPError as e:
            if e.code != 400:  # 400: not running
                raise
        wait_for(f"{user}'s server to stop", lambda: self.server(user) is None, timeout)


# -- the figures of `bash .ci/dev chart` --------------------------------------------------------


def can_run_dev_cluster() -> str:
    """Why the dev cluster cannot start here, or "" when it can."""
    import os

    if os.geteuid() != 0:
        return "the dev cluster needs root (network namespaces, nftables, mounts)"
    try:
        import gpulab.devcluster  # noqa: F401
    except ImportError:
        return "gpulab.devcluster is not installed (bash .ci/dev setup installs it)"
    return ""


def measure(out: Any = sys.stderr) -> dict[str, Any]:
    """A fresh dev cluster (stopped afterwards): install, seconds until the hub answers
    /hub/api through the proxy, then a GPU_PROFILE server spawned through it."""
    from helm_python import HelmError

    from gpulab.devcluster import DevCluster, NodeSpec, Timing, ensure_binaries

    figures: dict[str, Any] = {"install_ready_s": float("nan"), "spawn_ok": 0}
    ensure_binaries()  # built once per machine (minutes), as for the kube tests
    with tempfile.TemporaryDirectory(prefix="gpulab-chart-") as tmp:
        cluster = DevCluster(Path(tmp) / "dev-cluster", timing=Timing.fast())
        try:
            cluster.up(nodes=[NodeSpec("gpu-0", gpus=NODE_GPUS)], timeout=240)
            token = secrets.token_hex(16)
            with helm(cluster) as h:
                started = time.monotonic()
                install(h, CHART, check_values(token))
                hub = Hub(cluster, token)
                hub.wait()
                figures["install_ready_s"] = round(time.monotonic() - started, 1)
                print(f"install: the hub answered after {figures['install_ready_s']} s", file=out)
                started = time.monotonic()
                try:
                    hub.spawn(USER, GPU_PROFILE)
                except (OSError, TimeoutError, urllib.error.URLError) as e:
                    print(f"spawn of {GPU_PROFILE} failed: {e}", file=out)
                else:
                    figures["spawn_ok"] = 1
                    print(
                        f"spawn: {GPU_PROFILE} ready in {time.monotonic() - started:.1f} s",
                        file=out,
                    )
                    hub.stop(USER)
                h.uninstall(RELEASE, wait="watcher", timeout=120)
        except (HelmError, OSError, TimeoutError, urllib.error.URLError) as e:
            print(f"install on the dev cluster failed: {e}", file=out)
        finally:
            cluster.down()
    return figures


def main() -> int:
    why = can_run_dev_cluster()
    if why:
        print(f"install not measured: {why}", file=sys.stderr)
        figures = {"install_ready_s": float("nan"), "spawn_ok": 0}
    else:
        figures = measure()
    print(f"install_ready_s={figures['install_ready_s']} spawn_ok={figures['spawn_ok']}")
    return 0 if figures["spawn_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
