"""A dev cluster's state directory and how to talk to the cluster that runs from it.

Everything listens on 127.0.0.1 on free ports but the API server (on this machine's address on
the cluster's network, `podnet.host_address`, where kube-proxy sends the `kubernetes` Service's
traffic), the nodes' kubelet APIs (each on its node's address, port 10250) and kube-proxy (in the
nodes' network namespace); it lives in one state directory::

    STATE/cluster.json   ports, token, PIDs (with start times), nodes, timing, network octet
    STATE/kubeconfig     bearer token, https://API_HOST:PORT, insecure-skip-tls-verify
    STATE/kube-proxy.kubeconfig   kube-proxy's (user system:kube-proxy)
    STATE/logs/*.log     one log per process
    STATE/etcd, certs, secrets, agent/   data (removed by down()); secrets/kubelet: the kubelet CA

`ClusterState` reads that directory, waits for components and makes the small blocking API and
node-agent calls; `cluster.DevCluster` starts and stops the processes on top of it.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import procs

CRD_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"

# stop order: node agent first (its pods go with it), etcd last
COMPONENTS = (
    "agent",
    "kube-proxy",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-apiserver",
    "etcd",
)
STATE_ENTRIES = (
    "etcd",
    "certs",
    "secrets",
    "agent",
    "kubeconfig",
    "kube-proxy.kubeconfig",
    "kube-proxy.yaml",
    "cluster.json",
    "nodes.json",
)


class DevClusterError(RuntimeError):
    """The dev cluster could not start or answer; the message names the component and its log."""


@dataclass(frozen=True)
class Timing:
    """How fast the cluster notices a failed node. Defaults are Kubernetes'; fast() is for tests.

    heartbeat_seconds: node agent's Ready-condition and Lease renewal period (kubelet: 10 s).
    node_monitor_period_seconds / node_monitor_grace_seconds: controller-manager's
      --node-monitor-period / --node-monitor-grace-period: a node whose heartbeat is older than
      the grace period turns Ready=Unknown (NotReady) and gets the unreachable taints.
    toleration_seconds: kube-apiserver's --default-not-ready-toleration-seconds and
      --default-unreachable-toleration-seconds: how long pods stay on a NotReady node before the
      taint manager evicts (deletes) them.
    """

    heartbeat_seconds: float = 10.0
    node_monitor_period_seconds: int = 5
    node_monitor_grace_seconds: int = 40
    toleration_seconds: int = 300

    @classmethod
    def fast(cls) -> Timing:
        # heartbeats 8x per grace period: a loaded machine (tests in parallel) may delay a few
        return cls(
            heartbeat_seconds=2.0,
            node_monitor_period_seconds=2,
            node_monitor_grace_seconds=16,
            toleration_seconds=30,
        )


def default_state_dir() -> Path:
    return Path(
        os.environ.get("GPULAB_DEV_CLUSTER_DIR", Path.home() / ".cache" / "gpulab" / "dev-cluster")
    )


def _stderr(msg: str) -> None:
    print(f"gpulab dev-cluster: {msg}", file=sys.stderr, flush=True)


class ClusterState:
    """The state directory of one dev cluster, and the calls that read or ask the running one."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        timing: Timing | None = None,
        log: Callable[[str], None] = _stderr,
        pod_bin_dirs: Sequence[str | os.PathLike[str]] = (),
    ) -> None:
        """`pod_bin_dirs`: folders put first on the PATH pods find their commands on (before
        this environment's, e.g. a leaner `jupyterhub-singleuser` than gpulab's)."""
        self.state_dir = Path(state_dir or default_state_dir()).expanduser().resolve()
        self.timing = timing or Timing()
        self.log = log
        self.pod_bin_dirs = [Path(d) for d in pod_bin_dirs]

    # -- state ------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "cluster.json"

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self, state: dict[str, Any]) -> None:
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self._state_file)

    def _procs(self, state: dict[str, Any] | None = None) -> dict[str, procs.Proc]:
        state = self._read_state() if state is None else state
        return {name: procs.Proc.from_dict(d) for name, d in state.get("procs", {}).items()}

    @property
    def api_url(self) -> str:
        return _api_url(self._read_state())

    @property
    def token(self) -> str:
        return str(self._read_state()["token"])

    def env(self) -> dict[str, str]:
        """Environment for a process that should talk to this cluster (KubeSpawner, kubectl)."""
        return {"KUBECONFIG": str(self.kubeconfig)}

    async def api_client(self) -> Any:
        """A kubernetes_asyncio ApiClient for this cluster; the caller closes it."""
        from .agent.kube import api_client

        return await api_client(str(self.kubeconfig))

    def is_up(self) -> bool:
        found = self._procs()
        return (
            bool(found) and all(p.alive() for p in found.values()) and set(found) >= set(COMPONENTS)
        )

    def status(self) -> dict[str, Any]:
        """What runs: {"up", "state_dir", "kubeconfig", "api", "processes", "nodes"}."""
        state = self._read_state()
        found = self._procs(state)
        out: dict[str, Any] = {
            "up": self.is_up(),
            "state_dir": str(self.state_dir),
            "kubeconfig": str(self.kubeconfig) if self.kubeconfig.exists() else None,
            "api": _api_url(state) if state else None,
            "processes": {n: {"pid": p.pid, "running": p.alive()} for n, p in found.items()},
            "timing": state.get("timing"),
            "nodes": {},
        }
        if found.get("agent") and found["agent"].alive():
            try:
                out["nodes"] = self._agent("GET", "/nodes")
            except DevClusterError as e:
                out["nodes"] = {"error": str(e)}
        return out

    # -- waiting and talking ------------------------------------------------------------------

    def _wait(self, what: str, deadline: float, ok: Callable[[], bool]) -> None:
        state = self._read_state()
        while True:
            if ok():
                return
            for name, p in self._procs(state).items():
                if not p.alive():
                    raise DevClusterError(
                        f"{name} exited while waiting for {what}{self._tail(name)}"
                    )
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"timed out waiting for {what}; logs in {self.state_dir / 'logs'}"
                )
            time.sleep(0.2)

    def _tail(self, name: str, lines: int = 20) -> str:
        try:
            text = (self.state_dir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        tail = "\n".join(text.strip().splitlines()[-lines:])
        return f"; last lines of {self.state_dir / 'logs' / name}.log:\n{tail}"

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def api(self, method: str, path: str, body: Any = None, timeout: float = 10) -> Any:
        """A small blocking API call (JSON in, JSON out) for tools and tests."""
        state = self._read_state()
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        req = urllib.request.Request(
            f"{_api_url(state)}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {state['token']}",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            data = r.read()
        try:
            return json.loads(data)
        except ValueError:
            return data.decode(errors="replace")

    def crds_established(self, names: Sequence[str]) -> bool:
        """Whether the API server has each CustomResourceDefinition named `Established` (it
        serves the kind); False while one is missing or the server does not answer."""
        for name in names:
            try:
                got = self.api("GET", f"{CRD_API}/{name}")
            except (OSError, urllib.error.URLError):
                return False
            conds = (got.get("status") or {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                return False
        return True

    def _api_ok(self, path: str) -> bool:
        try:
            return self.api("GET", path, timeout=3) == "ok"
        except (OSError, urllib.error.URLError):
            return False

    def _default_service_account_ready(self) -> bool:
        try:
            sa = self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=3)
        except (OSError, urllib.error.URLError):
            return False
        # made by the service-account controller (1.24+ makes no token Secret for it: pods get
        # projected tokens from the TokenRequest API)
        return bool(sa.get("metadata", {}).get("name"))

    def _nodes_ready(self, names: set[str]) -> bool:
        try:
            items = self.api("GET", "/api/v1/nodes", timeout=3)["items"]
        except (OSError, urllib.error.URLError, KeyError):
            return False
        ready = {
            n["metadata"]["name"]
            for n in items
            for c in n.get("status", {}).get("conditions", [])
            if c["type"] == "Ready" and c["status"] == "True"
        }
        return names <= ready

    def _write_kubeconfig(
        self, state: dict[str, Any], path: Path | None = None, *, token_key: str = "token"
    ) -> None:
        """The admin's kubeconfig (or, with token_key, another identity's at `path`)."""
        path = self.kubeconfig if path is None else path
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "gpulab-dev",
                    "cluster": {"server": _api_url(state), "insecure-skip-tls-verify": True},
                }
            ],
            "users": [{"name": "gpulab-admin", "user": {"token": state[token_key]}}],
            "contexts": [
                {"name": "gpulab-dev", "context": {"cluster": "gpulab-dev", "user": "gpulab-admin"}}
            ],
            "current-context": "gpulab-dev",
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            yaml.safe_dump(config, fh, sort_keys=False)

    def _agent(self, method: str, path: str) -> Any:
        try:
            control = json.loads((self.state_dir / "agent" / "control.json").read_text())
            req = urllib.request.Request(f"http://127.0.0.1:{control['port']}{path}", method=method)
            with urllib.request.urlopen(req, timeout=15) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise DevClusterError(f"node agent: {e.read().decode(errors='replace')}") from e
        except (OSError, ValueError, KeyError) as e:
            raise DevClusterError(
                f"the node agent does not answer ({e}); is the cluster up?"
            ) from e


def _api_url(state: dict[str, Any]) -> str:
    # clusters started before the API server moved onto the cluster's network used 127.0.0.1
    return f"https://{state.get('api_host', '127.0.0.1')}:{state['ports']['apiserver']}"
