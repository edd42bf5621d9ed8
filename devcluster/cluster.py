"""DevCluster: etcd + kube-apiserver + kube-scheduler + kube-controller-manager + node agent.

Everything listens on 127.0.0.1 on free ports and lives in one state directory::

    STATE/cluster.json   ports, token, PIDs (with start times), nodes, timing
    STATE/kubeconfig     bearer token, https://127.0.0.1:PORT, insecure-skip-tls-verify
    STATE/logs/*.log     one log per process
    STATE/etcd, certs, secrets, agent/   data (removed by down())

The methods block (up() may build the binaries first: minutes, once per machine); from async
code call them in an executor, e.g. ``await asyncio.to_thread(cluster.up)``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from . import build, procs
from .spec import NodeSpec, default_nodes

AGENT_MODULE = "gpulab.devcluster.agent"
# stop order: node agent first (its pods go with it), etcd last
COMPONENTS = ("agent", "kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd")
STATE_ENTRIES = ("etcd", "certs", "secrets", "agent", "kubeconfig", "cluster.json", "nodes.json")


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
      taint manager evicts (deletes) them. (--pod-eviction-timeout is ignored in 1.20.)
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


class DevCluster:
    """A local Kubernetes control plane with simulated GPU nodes.

    >>> cluster = DevCluster(state_dir=tmp)        # or DevCluster.default()
    >>> cluster.up(nodes=[NodeSpec("gpu-0", gpus=8)])
    >>> cluster.kubeconfig                         # Path to pass to any Kubernetes client
    >>> cluster.stop_node("gpu-0"); cluster.start_node("gpu-0")
    >>> cluster.down()
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        timing: Timing | None = None,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        self.state_dir = Path(state_dir or default_state_dir()).expanduser().resolve()
        self.timing = timing or Timing()
        self.log = log

    @classmethod
    def default(cls, **kw: Any) -> DevCluster:
        return cls(default_state_dir(), **kw)

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
        return f"https://127.0.0.1:{self._read_state()['ports']['apiserver']}"

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
            "api": f"https://127.0.0.1:{state['ports']['apiserver']}" if state else None,
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

    # -- up ---------------------------------------------------------------------------------

    def up(
        self,
        nodes: list[NodeSpec] | None = None,
        *,
        timeout: float = 180.0,
        retry_ports: bool = True,
    ) -> DevCluster:
        """Start everything (building the binaries first if the cache lacks them).

        Idempotent: when the cluster already runs it is left alone (a different node list is an
        error; down() first). Returns self.
        """
        nodes = default_nodes() if nodes is None else list(nodes)
        if self.is_up():
            running = self._read_state().get("nodes", [])
            if running != [n.to_dict() for n in nodes]:
                raise DevClusterError(
                    f"the dev cluster in {self.state_dir} already runs with nodes "
                    f"{[n['name'] for n in running]}, not {[n.name for n in nodes]}; "
                    "run 'gpulab dev-cluster down' first"
                )
            self.log(f"already running (kubeconfig {self.kubeconfig})")
            return self
        if self._procs():
            self.log("a previous dev cluster is partly running; stopping it first")
            self.down()
        bins = build.ensure_binaries()
        build.ensure_system_packages(build.missing_system_packages(build.RUNTIME_PACKAGES))
        etcd = shutil.which("etcd")
        if not etcd:
            raise DevClusterError("etcd is not installed: apt-get install -y etcd-server")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # root's alone: the kubeconfig and cluster.json hold a cluster-admin token, and pods run
        # as other uids (runAsUser) on this machine's file system
        self.state_dir.chmod(0o700)
        self._clean_data()
        t0 = time.monotonic()
        deadline = t0 + timeout
        state: dict[str, Any] = {
            "token": secrets.token_hex(24),
            "ports": {
                k: procs.free_port()
                for k in ("etcd", "etcd_peer", "apiserver", "scheduler", "controller_manager")
            },
            "procs": {},
            "nodes": [n.to_dict() for n in nodes],
            "timing": asdict(self.timing),
        }
        self._write_state(state)
        try:
            self._start_control_plane(state, bins, etcd, deadline)
            self._start_agent(state, nodes, deadline)
        except DevClusterError as e:
            self.log("start failed; stopping what was started")
            self.down(purge=False)
            if "address already in use" in str(e) and retry_ports:
                self.log("a port was taken meanwhile; starting again with other ports")
                return self.up(nodes, timeout=timeout, retry_ports=False)
            raise
        except BaseException:
            self.log("start failed; stopping what was started")
            self.down(purge=False)
            raise
        self.log(
            f"up in {time.monotonic() - t0:.1f} s: API {self.api_url}, "
            f"{len(nodes)} node(s), kubeconfig {self.kubeconfig}"
        )
        return self

    def _clean_data(self, *, logs: bool = True) -> None:
        for name in STATE_ENTRIES:
            p = self.state_dir / name
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()
        if logs:
            shutil.rmtree(self.state_dir / "logs", ignore_errors=True)
            (self.state_dir / "logs").mkdir(parents=True)

    def _start(self, state: dict[str, Any], name: str, argv: list[str], **kw: Any) -> None:
        p = procs.launch(name, argv, self.state_dir / "logs" / f"{name}.log", **kw)
        state["procs"][name] = p.to_dict()
        self._write_state(state)

    def _start_control_plane(
        self, state: dict[str, Any], bins: dict[str, Path], etcd: str, deadline: float
    ) -> None:
        d, ports, t = self.state_dir, state["ports"], self.timing
        sec = d / "secrets"
        sec.mkdir(mode=0o700)
        subprocess.run(
            ["openssl", "genrsa", "-out", str(sec / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["openssl", "rsa", "-in", str(sec / "sa.key"), "-pubout", "-out", str(sec / "sa.pub")],
            check=True,
            capture_output=True,
        )
        (sec / "tokens.csv").write_text(f"{state['token']},admin,admin,system:masters\n")
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        self._start(
            state,
            "etcd",
            [
                etcd,
                "--name=gpulab-dev",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
                f"--initial-cluster=gpulab-dev=http://127.0.0.1:{ports['etcd_peer']}",
                "--unsafe-no-fsync",
            ],
        )
        self._wait("etcd", deadline, lambda: self._http_ok(f"{etcd_url}/health"))
        certs = d / "certs"
        self._start(
            state,
            "kube-apiserver",
            [
                str(bins["kube-apiserver"]),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={certs}",
                f"--token-auth-file={sec / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={sec / 'sa.pub'}",
                f"--service-account-signing-key-file={sec / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                f"--default-not-ready-toleration-seconds={t.toleration_seconds}",
                f"--default-unreachable-toleration-seconds={t.toleration_seconds}",
            ],
        )
        self._write_kubeconfig(state)
        self._wait("kube-apiserver", deadline, lambda: self._api_ok("/readyz"))
        kc = str(self.kubeconfig)
        common = [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            "--port=0",  # no insecure port (1.20 defaults to 0.0.0.0:10251/10252)
            "--leader-elect=false",
        ]
        self._start(
            state,
            "kube-scheduler",
            [str(bins["kube-scheduler"]), *common, f"--secure-port={ports['scheduler']}"],
        )
        self._start(
            state,
            "kube-controller-manager",
            [
                str(bins["kube-controller-manager"]),
                *common,
                f"--secure-port={ports['controller_manager']}",
                f"--service-account-private-key-file={sec / 'sa.key'}",
                f"--root-ca-file={certs / 'apiserver.crt'}",
                "--controllers=*,-nodeipam,-cloud-node-lifecycle",
                f"--node-monitor-period={t.node_monitor_period_seconds}s",
                f"--node-monitor-grace-period={t.node_monitor_grace_seconds}s",
                f"--node-startup-grace-period={max(30, t.node_monitor_grace_seconds)}s",
                f"--pod-eviction-timeout={t.toleration_seconds}s",
            ],
        )
        self._wait(
            "default ServiceAccount (kube-controller-manager)",
            deadline,
            self._default_service_account_ready,
        )
        self._install_snapshot_api(deadline)

    def _install_snapshot_api(self, deadline: float) -> None:
        """The snapshot.storage.k8s.io/v1 CRDs and the gpulab-local VolumeSnapshotClass (the node
        agent is their snapshotter and driver)."""
        from .agent import snapshots

        for crd in snapshots.crds():
            try:
                self.api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    detail = e.read().decode(errors="replace")
                    raise DevClusterError(
                        f"installing CRD {crd['metadata']['name']}: {detail}"
                    ) from e

        def established() -> bool:
            for crd in snapshots.crds():
                name = crd["metadata"]["name"]
                try:
                    got = self.api(
                        "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
                    )
                except (OSError, urllib.error.URLError):
                    return False
                conds = (got.get("status") or {}).get("conditions") or []
                if not any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                    return False
            return True

        self._wait("VolumeSnapshot CRDs established", deadline, established)
        path = f"/apis/{snapshots.API_VERSION}/volumesnapshotclasses"

        def class_created() -> bool:
            try:
                self.api("POST", path, snapshots.snapshot_class())
            except urllib.error.HTTPError as e:
                return e.code == 409
            except (OSError, urllib.error.URLError):
                return False
            return True

        self._wait("VolumeSnapshotClass gpulab-local", deadline, class_created)

    def _start_agent(self, state: dict[str, Any], nodes: list[NodeSpec], deadline: float) -> None:
        agent_dir = self.state_dir / "agent"
        agent_dir.mkdir()
        nodes_file = self.state_dir / "nodes.json"
        nodes_file.write_text(json.dumps([n.to_dict() for n in nodes], indent=2))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # pods find this environment's commands (jupyterhub-singleuser...) on their PATH
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
        self._start(
            state,
            "agent",
            [
                sys.executable,
                "-m",
                AGENT_MODULE,
                f"--kubeconfig={self.kubeconfig}",
                f"--state-dir={agent_dir}",
                f"--nodes-file={nodes_file}",
                f"--heartbeat-seconds={self.timing.heartbeat_seconds}",
            ],
            env=env,
        )
        names = {n.name for n in nodes}
        self._wait("node agent", deadline, lambda: (agent_dir / "control.json").exists())
        self._wait(f"nodes {sorted(names)} Ready", deadline, lambda: self._nodes_ready(names))

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
            f"https://127.0.0.1:{state['ports']['apiserver']}{path}",
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
        return bool(sa.get("secrets"))  # the token controller added its token secret

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

    def _write_kubeconfig(self, state: dict[str, Any]) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "gpulab-dev",
                    "cluster": {
                        "server": f"https://127.0.0.1:{state['ports']['apiserver']}",
                        "insecure-skip-tls-verify": True,
                    },
                }
            ],
            "users": [{"name": "gpulab-admin", "user": {"token": state["token"]}}],
            "contexts": [
                {"name": "gpulab-dev", "context": {"cluster": "gpulab-dev", "user": "gpulab-admin"}}
            ],
            "current-context": "gpulab-dev",
        }
        fd = os.open(self.kubeconfig, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            yaml.safe_dump(config, fh, sort_keys=False)

    # -- nodes ------------------------------------------------------------------------------

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

    def nodes(self) -> dict[str, Any]:
        """The agent's view: {node: {"running": bool, "pods": [...]}}."""
        return dict(self._agent("GET", "/nodes"))

    def stop_node(self, name: str) -> None:
        """Simulate a node failure: stop heartbeats of node `name` and kill its pods' processes.

        The API is not told; the node controller marks the node NotReady after
        timing.node_monitor_grace_seconds and evicts its pods after timing.toleration_seconds.
        """
        self._agent("POST", f"/nodes/{name}/stop")

    def start_node(self, name: str) -> None:
        """Bring a stopped node back: heartbeats resume and the unreachable taints are removed."""
        self._agent("POST", f"/nodes/{name}/start")

    def logs(self, pod: str, namespace: str = "default", container: str | None = None) -> str:
        """A container's output (stdout + stderr), like `kubectl logs`; "" when there is none.

        The file lives until the pod is deleted: STATE/agent/pods/NS_POD_UID/CONTAINER.log.
        """
        dirs = sorted((self.state_dir / "agent" / "pods").glob(f"{namespace}_{pod}_*"))
        if not dirs:
            return ""
        files = sorted(dirs[-1].glob(f"{container or '*'}.log"))
        return "".join(f.read_text(errors="replace") for f in files)

    # -- down -------------------------------------------------------------------------------

    def down(self, *, purge: bool = True) -> list[str]:
        """Stop every process this cluster started (SIGTERM, then SIGKILL); returns their names.

        purge removes the cluster's data (etcd, volumes, kubeconfig) but keeps logs/.
        """
        found = self._procs()
        stopped: list[str] = []
        for name in COMPONENTS:
            if name in found:
                stopped += procs.stop([found[name]], grace_seconds=10 if name == "agent" else 5)
        marker = str(self.state_dir) + os.sep
        strays = procs.stray_processes(marker, ("launcher.py", AGENT_MODULE, "kube-", "etcd"))
        if strays:
            stopped += procs.stop(strays, grace_seconds=2)
        from .agent.runtime import remove_recorded

        remove_recorded(self.state_dir / "agent" / "host-paths.json")
        if purge:
            self._clean_data(logs=False)
        elif self._state_file.exists():
            state = self._read_state()
            state["procs"] = {}
            self._write_state(state)
        return stopped

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
