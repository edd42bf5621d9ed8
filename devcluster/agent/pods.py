"""Running the pods bound to one node as local processes, and reporting them as a kubelet does.

Per pod a PodWorker: volumes -> init containers -> containers (one launcher each, see runtime.py)
-> status patches (Pending/Running/Succeeded/Failed, conditions, containerStatuses) -> on deletion
preStop, SIGTERM, SIGKILL after the grace period, then delete with gracePeriodSeconds=0.

Differences from a kubelet (documented in the package README): images are ignored (command + args
run on the host; the "image's user" is the agent's), securityContext is applied as far as
`podsecurity` says (uid, gids, fsGroup, runAsNonRoot, no_new_privs, capabilities; no seccomp),
liveness/startup probes are ignored, readiness probes (httpGet, tcpSocket, exec) are run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from . import podenv, podsecurity, podvolumes
from .devices import Devices
from .kube import MERGE, Events, log, now, raw, status_of, watch_forever
from .netpolicy import Enforcer
from .runtime import ContainerProcess, HostPaths, StartError

TERMINAL = ("Succeeded", "Failed")
MAX_BACKOFF_SECONDS = 300


class IPPool:
    """Loopback addresses for one node's pods: PREFIX.2 .. PREFIX.254, reused round-robin."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._used: set[int] = set()
        self._next = 2

    def allocate(self) -> str:
        for _ in range(253):
            n, self._next = self._next, 2 + (self._next - 1) % 253
            if n not in self._used:
                self._used.add(n)
                return f"{self.prefix}.{n}"
        raise RuntimeError(f"no free pod address left in {self.prefix}.0/24")

    def release(self, ip: str | None) -> None:
        if ip and ip.startswith(self.prefix + "."):
            self._used.discard(int(ip.rsplit(".", 1)[1]))


@dataclass
class NodeContext:
    """What a node's pod workers share."""

    name: str
    host_ip: str
    core: client.CoreV1Api
    events: Events
    ips: IPPool
    host_paths: HostPaths
    pods_dir: Path
    capacity: dict[str, str]
    base_env: dict[str, str]
    devices: Devices
    #: NetworkPolicy enforcement (None: this machine cannot; the agent said why at start)
    netpol: Enforcer | None = None


@dataclass
class ContainerState:
    spec: dict[str, Any]
    init: bool = False
    proc: ContainerProcess | None = None
    restart_count: int = 0
    ready: bool = False
    waiting: dict[str, str] = field(default_factory=lambda: {"reason": "ContainerCreating"})
    terminated: dict[str, Any] | None = None
    last_state: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    identity: podsecurity.Identity | None = None

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.running and self.terminated is None

    def container_id(self) -> str:
        return f"gpulab://{self.name}-{self.restart_count}"

    def state(self) -> dict[str, Any]:
        if self.terminated is not None:
            return {"terminated": self.terminated}
        if self.running and self.proc is not None:
            return {"running": {"startedAt": self.proc.started_at}}
        return {"waiting": self.waiting}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image") or "",
            "imageID": "",
            "ready": self.ready and self.running,
            "restartCount": self.restart_count,
            "started": self.running,
            "state": self.state(),
            "lastState": self.last_state,
        }
        if self.proc is not None and self.proc.started_at:
            out["containerID"] = self.container_id()
        return out


def _restart(policy: str, code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and code != 0)


class PodWorker:
    def __init__(self, node: NodeContext, pod: dict[str, Any]) -> None:
        self.node = node
        self.pod = pod
        meta = pod["metadata"]
        self.name, self.ns, self.uid = meta["name"], meta["namespace"], meta["uid"]
        self.key = f"{self.ns}/{self.name}"
        self.dir = node.pods_dir / f"{self.ns}_{self.name}_{self.uid[:8]}"
        spec = pod.get("spec") or {}
        self.policy = spec.get("restartPolicy") or "Always"
        self.init = [ContainerState(c, init=True) for c in spec.get("initContainers") or []]
        self.containers = [ContainerState(c) for c in spec.get("containers") or []]
        self.ip: str | None = None
        self.phase = "Pending"
        self.initialized = not self.init
        self.start_time = now()
        self.transitions: dict[str, tuple[str, str]] = {}
        self.changed = asyncio.Event()
        self.dirty = asyncio.Event()
        self._patch_lock = asyncio.Lock()
        self.held: list[Path] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.mount_message: str | None = None
        self.deleted = False  # gone from the API
        self.cgroup_procs: Path | None = None  # the pod's cgroup (NetworkPolicy enforcement)
        self.task: asyncio.Task[Any] | None = None

    # -- inputs -----------------------------------------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.changed.set()
        if self.node.netpol is not None and self.cgroup_procs is not None:
            task = asyncio.create_task(self.node.netpol.relabel(pod))  # policies select by label
            self.tasks.append(task)

    def gone(self) -> None:
        self.deleted = True
        self.changed.set()

    @property
    def deleting(self) -> bool:
        return self.deleted or bool(self.pod["metadata"].get("deletionTimestamp"))

    async def _wait_change(self, timeout: float | None = None) -> None:
        self.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        writer = asyncio.create_task(self._status_writer())
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s: agent error", self.key)
        finally:
            writer.cancel()
            await self._cleanup()

    async def _run(self) -> None:
        status = self.pod.get("status") or {}
        if status.get("phase") in TERMINAL:
            await self._finish()
            return
        if self._was_started(status):
            if self.policy == "Never":
                await self._report_lost(status)
                await self._finish()
                return
            for cs in self.containers:
                prev = next(
                    (s for s in status.get("containerStatuses") or [] if s["name"] == cs.name), {}
                )
                cs.restart_count = int(prev.get("restartCount", 0)) + 1
                cs.last_state = self._lost_state(prev)
            self.initialized, self.init = True, []
        if self.deleting:
            await self._delete()
            return
        self.ip = self.node.ips.allocate()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "home").mkdir(exist_ok=True)
        self._jupyter_allow_root()
        await self._patch()
        volumes = await self._prepare_volumes()
        if volumes is None:
            await self._terminate()
            return
        if not await self._join_network():
            await self._terminate()
            return
        for cs in self.init:
            ok = await self._run_init(cs, volumes)
            if ok is None:  # deleted meanwhile
                await self._terminate()
                return
            if not ok:
                self.phase = "Failed"
                self.dirty.set()
                await self._finish()
                return
        self.initialized = True
        self.tasks = [asyncio.create_task(self._supervise(cs, volumes)) for cs in self.containers]
        done = asyncio.gather(*self.tasks)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        while not self.deleting and not done.done():
            self.changed.clear()
            waiter = asyncio.create_task(self.changed.wait())
            try:
                await asyncio.wait([waiter, done], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        if self.deleting:
            await self._terminate()
            return
        failed = any((cs.terminated or {}).get("exitCode", 0) != 0 for cs in self.containers)
        self.phase = "Failed" if failed else "Succeeded"
        await self._patch()
        await self._finish()

    def _was_started(self, status: dict[str, Any]) -> bool:
        return status.get("phase") == "Running" or any(
            "running" in (s.get("state") or {}) or s.get("restartCount")
            for s in status.get("containerStatuses") or []
        )

    @staticmethod
    def _lost_state(prev: dict[str, Any]) -> dict[str, Any]:
        started = ((prev.get("state") or {}).get("running") or {}).get("startedAt")
        return {
            "terminated": {
                "exitCode": 137,
                "reason": "Error",
                "message": "the node agent lost the container: its node was stopped or restarted",
                "startedAt": started,
                "finishedAt": now(),
            }
        }

    async def _report_lost(self, status: dict[str, Any]) -> None:
        for cs in self.containers:
            prev = next(
                (s for s in status.get("containerStatuses") or [] if s["name"] == cs.name), {}
            )
            cs.restart_count = int(prev.get("restartCount", 0))
            cs.terminated = self._lost_state(prev)["terminated"]
        self.ip = status.get("podIP")
        self.initialized = True
        self.phase = "Failed"
        await self._patch()
        self.ip = None
        await self.node.events.emit(
            self.pod,
            "NodeLost",
            "the node agent lost this pod's processes (node stopped)",
            type_="Warning",
            host=self.node.name,
        )

    async def _finish(self) -> None:
        """A terminal pod stays until it is deleted; then the kubelet deletes it at once."""
        self.node.devices.release(self.uid)  # as the device manager: only active pods hold devices
        while not self.deleting:
            await self._wait_change()
        await self._delete()

    async def _delete(self) -> None:
        if self.deleted:
            return
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            await raw(
                self.node.core.delete_namespaced_pod(
                    self.name, self.ns, body=body, _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) not in (404, 409):
                log.warning("pod %s: delete failed: %s", self.key, e)
        self.deleted = True

    async def _cleanup(self) -> None:
        """Local only (also runs when the node is stopped): no API calls here."""
        for t in self.tasks:
            t.cancel()
        for cs in [*self.init, *self.containers]:
            if cs.proc is not None:
                await cs.proc.kill_and_wait()
        self.node.host_paths.release(self.held)
        self.held = []
        if self.node.netpol is not None and self.cgroup_procs is not None:
            with contextlib.suppress(RuntimeError):
                await self.node.netpol.leave(self.uid)
            self.cgroup_procs = None
        self.node.ips.release(self.ip)
        self.node.devices.release(self.uid)
        if self.deleted:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- volumes and containers -------------------------------------------------------------

    def _jupyter_allow_root(self) -> None:
        """Containers without runAsUser run as the agent's account (root) here, where an image
        would run as its USER (jovyan): let a Jupyter server start as root instead of refusing
        (found via JUPYTER_CONFIG_PATH, set for root containers only)."""
        d = self.dir / "jupyter-config"
        d.mkdir(exist_ok=True)
        (d / "jupyter_server_config.json").write_text('{"ServerApp": {"allow_root": true}}\n')

    async def _join_network(self) -> bool:
        """The pod's cgroup and the NetworkPolicy table that covers it, before any of its
        processes start (a pod is never up unprotected); retried while nft refuses."""
        if self.node.netpol is None:
            return True
        reported = False
        while not self.deleting:
            try:
                self.cgroup_procs = await self.node.netpol.join(self.pod, self.ip or "")
                return True
            except (RuntimeError, OSError) as e:
                log.error("pod %s: %s", self.key, e)
                if not reported:
                    reported = True
                    await self.node.events.emit(
                        self.pod,
                        "FailedNetworkPolicy",
                        f"NetworkPolicies could not be applied: {str(e)[:500]}",
                        type_="Warning",
                        host=self.node.name,
                    )
            await self._wait_change(2.0)
        return False

    async def _prepare_volumes(self) -> dict[str, tuple[Path, bool]] | None:
        while not self.deleting:
            try:
                volumes = await podvolumes.prepare(
                    self.node.core, self.pod, self.dir, fs_group=podsecurity.fs_group(self.pod)
                )
                self.mount_message = None
                return volumes
            except podvolumes.MountError as e:
                msg = f"MountVolume.SetUp failed: {e}"
                if msg != self.mount_message:
                    self.mount_message = msg
                    await self.node.events.emit(
                        self.pod, "FailedMount", msg, type_="Warning", host=self.node.name
                    )
            except Exception as e:
                log.warning("pod %s: preparing volumes: %s", self.key, e)
            await self._wait_change(2.0)
        return None

    def _launch_spec(
        self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]
    ) -> dict[str, Any]:
        pod = {
            **self.pod,
            "status": {
                **(self.pod.get("status") or {}),
                "podIP": self.ip,
                "hostIP": self.node.host_ip,
            },
        }
        secrets = getattr(self, "_secrets", {})
        configmaps = getattr(self, "_configmaps", {})
        ident = podsecurity.identity(self.pod, cs.spec, image_uid=os.getuid())
        cs.identity = ident
        # the pod folders are the agent's alone (0700): a process of another uid finds its
        # HOME where a runtime would put it, and reaches its volumes only at their mount paths
        as_agent = ident.uid == os.getuid()
        base = {
            **self.node.base_env,
            "HOME": podsecurity.default_home(ident.uid, str(self.dir / "home")),
            "HOSTNAME": self.name,
        }
        if as_agent:
            base["JUPYTER_CONFIG_PATH"] = str(self.dir / "jupyter-config")
        cs.env = podenv.container_env(
            pod,
            cs.spec,
            base=base,
            configmaps=configmaps,
            secrets=secrets,
            node_capacity=self.node.capacity,
        )
        cs.env.update(self.node.devices.allocate(f"{self.uid}/{cs.name}", cs.spec))
        argv = podenv.container_argv(cs.spec, cs.env, self.ip or "")
        if not argv:
            raise StartError(
                "no command: the gpulab node agent runs the container's command + args on the host "
                "(an image's entrypoint is not available); set command or args"
            )
        mounts = []
        for vm in cs.spec.get("volumeMounts") or []:
            if vm["name"] not in volumes:
                raise StartError(f'volumeMount "{vm["name"]}": no volume of that name in the pod')
            src, ro = volumes[vm["name"]]
            if vm.get("subPath"):
                src = src / vm["subPath"]
                if not src.exists():
                    src.mkdir(parents=True)
            mounts.append(
                {
                    "source": str(src),
                    "target": vm["mountPath"],
                    "readOnly": bool(vm.get("readOnly") or ro),
                    "file": src.is_file(),
                }
            )
        targets = [Path(m["target"]) for m in mounts]

        def covered(p: Path) -> bool:
            return any(t in p.parents for t in targets)

        for m in mounts:
            t = Path(m["target"])
            if not covered(t):
                self.held += self.node.host_paths.acquire(t, is_file=m["file"])
        wd = cs.spec.get("workingDir") or (str(self.dir / "home") if as_agent else "/")
        if not covered(Path(wd)) and Path(wd) not in targets and not Path(wd).exists():
            self.held += self.node.host_paths.acquire(Path(wd))
        return {
            "argv": argv,
            "env": cs.env,
            "workingDir": wd,
            "mounts": mounts,
            "identity": ident.as_spec(),
            "cgroupProcs": str(self.cgroup_procs) if self.cgroup_procs else None,
        }

    async def _load_env_objects(self) -> None:
        cms, secs = podenv.referenced_objects(self.pod)
        core = self.node.core
        self._configmaps = await self._read_optional(core.read_namespaced_config_map, cms)
        self._secrets = await self._read_optional(core.read_namespaced_secret, secs)

    async def _read_optional(self, read: Any, names: Any) -> dict[str, dict[str, Any] | None]:
        """name -> object, or None where it does not exist (the pod's env decides if that is fatal)."""
        found: dict[str, dict[str, Any] | None] = {}
        for name in names:
            try:
                found[name] = await raw(read(name, self.ns, _preload_content=False))
            except Exception as e:
                if status_of(e) != 404:
                    raise
                found[name] = None
        return found

    async def _start(self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]) -> bool:
        """Start one run of the container; False (and a terminated StartError state) if it failed."""
        cs.terminated = None
        cs.ready = False
        try:
            await self._load_env_objects()
            launch = self._launch_spec(cs, volumes)
        except (podenv.EnvError, podsecurity.SecurityConfigError) as e:
            cs.waiting = {"reason": "CreateContainerConfigError", "message": str(e)}
            self.dirty.set()
            await self.node.events.emit(
                self.pod, "Failed", f"Error: {e}", type_="Warning", host=self.node.name
            )
            return False
        except (StartError, ValueError) as e:
            return await self._start_failed(cs, str(e))
        cs.proc = ContainerProcess(
            cs.name, self.dir / f"{cs.name}.json", self.dir / f"{cs.name}.log"
        )
        try:
            await cs.proc.start(launch)
        except StartError as e:
            return await self._start_failed(cs, str(e))
        cs.waiting = {}
        await self.node.events.emit(
            self.pod,
            "Started",
            f"Started container {cs.name}",
            host=self.node.name,
            field_path=f"spec.{'initContainers' if cs.init else 'containers'}{{{cs.name}}}",
        )
        probe = cs.spec.get("readinessProbe")
        if cs.init:
            pass
        elif probe and any(k in probe for k in ("httpGet", "tcpSocket", "exec")):
            self.tasks.append(asyncio.create_task(self._probe_loop(cs, probe)))
        else:
            cs.ready = True
        self.phase = "Running" if not cs.init else self.phase
        self.dirty.set()
        return True

    async def _start_failed(self, cs: ContainerState, message: str) -> bool:
        ts = now()
        cs.terminated = {
            "exitCode": 128,
            "reason": "StartError",
            "message": message,
            "startedAt": "1970-01-01T00:00:00Z",
            "finishedAt": ts,
            "containerID": cs.container_id(),
        }
        self.dirty.set()
        await self.node.events.emit(
            self.pod,
            "Failed",
            f'Error: failed to start container "{cs.name}": {message}',
            type_="Warning",
            host=self.node.name,
            field_path=f"spec.{'initContainers' if cs.init else 'containers'}{{{cs.name}}}",
        )
        return False

    async def _exited(self, cs: ContainerState) -> int:
        assert cs.proc is not None
        code = await cs.proc.wait()
        cs.ready = False
        cs.terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": cs.proc.started_at,
            "finishedAt": cs.proc.finished_at or now(),
            "containerID": cs.container_id(),
        }
        self.dirty.set()
        return code

    async def _backoff(self, cs: ContainerState, delay: float) -> None:
        cs.last_state = {"terminated": cs.terminated} if cs.terminated else {}
        cs.terminated = None
        cs.restart_count += 1
        cs.waiting = {
            "reason": "CrashLoopBackOff",
            "message": f"back-off {delay:.0f}s restarting failed container={cs.name} pod={self.name}_{self.ns}({self.uid})",
        }
        self.dirty.set()
        await self.node.events.emit(
            self.pod,
            "BackOff",
            "Back-off restarting failed container",
            type_="Warning",
            host=self.node.name,
        )
        await asyncio.sleep(delay)

    async def _run_init(
        self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]
    ) -> bool | None:
        delay = 10.0
        while not self.deleting:
            code = await self._exited(cs) if await self._start(cs, volumes) else 128
            if self.deleting:
                return None
            if code == 0:
                return True
            if self.policy == "Never":
                return False
            await self._backoff(cs, delay)
            delay = min(delay * 2, MAX_BACKOFF_SECONDS)
        return None

    async def _supervise(self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]) -> None:
        delay = 10.0
        while True:
            started = await self._start(cs, volumes)
            if not started and cs.terminated is None:  # config error: retry like a kubelet
                await asyncio.sleep(delay)
                continue
            code = await self._exited(cs) if started else 128
            if self.deleting or not _restart(self.policy, code):
                return
            if cs.proc is not None and time.monotonic() - cs.proc.started_mono > 600:
                delay = 10.0
            await self._backoff(cs, delay)
            delay = min(delay * 2, MAX_BACKOFF_SECONDS)

    # -- readiness --------------------------------------------------------------------------

    async def _probe_loop(self, cs: ContainerState, probe: dict[str, Any]) -> None:
        await asyncio.sleep(float(probe.get("initialDelaySeconds") or 0))
        period = float(probe.get("periodSeconds") or 10)
        timeout = float(probe.get("timeoutSeconds") or 1)
        need_ok, need_fail = (
            int(probe.get("successThreshold") or 1),
            int(probe.get("failureThreshold") or 3),
        )
        ok_run = fail_run = 0
        while cs.running:
            ok = await self._probe_once(cs, probe, timeout)
            ok_run, fail_run = (ok_run + 1, 0) if ok else (0, fail_run + 1)
            if ok and ok_run >= need_ok and not cs.ready:
                cs.ready = True
                self.dirty.set()
            elif not ok and fail_run >= need_fail and cs.ready:
                cs.ready = False
                self.dirty.set()
                await self.node.events.emit(
                    self.pod,
                    "Unhealthy",
                    "Readiness probe failed",
                    type_="Warning",
                    host=self.node.name,
                )
            await asyncio.sleep(period)

    def _port(self, cs: ContainerState, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in cs.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"named port {port!r} not in container {cs.name}")

    async def _probe_once(self, cs: ContainerState, probe: dict[str, Any], timeout: float) -> bool:
        try:
            if "httpGet" in probe:
                g = probe["httpGet"]
                scheme = (g.get("scheme") or "HTTP").lower()
                host = g.get("host") or self.ip
                url = f"{scheme}://{host}:{self._port(cs, g['port'])}{g.get('path') or '/'}"
                headers = {h["name"]: h["value"] for h in g.get("httpHeaders") or []}
                ctx = ssl.create_default_context()
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
                    s.get(
                        url,
                        headers=headers,
                        ssl=ctx if scheme == "https" else None,
                        allow_redirects=False,
                    ) as r,
                ):
                    return 200 <= r.status < 400
            if "tcpSocket" in probe:
                t = probe["tcpSocket"]
                _, w = await asyncio.wait_for(
                    asyncio.open_connection(t.get("host") or self.ip, self._port(cs, t["port"])),
                    timeout,
                )
                w.close()
                return True
            if "exec" in probe and cs.proc is not None:
                wd = cs.spec.get("workingDir")
                rc = await cs.proc.exec(
                    probe["exec"]["command"], cs.env, wd, timeout, identity=cs.identity
                )
                return rc == 0
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            return False
        return False

    # -- deletion ---------------------------------------------------------------------------

    def _grace_seconds(self) -> float:
        if self.deleted:  # force-deleted (gracePeriodSeconds=0): the object is gone, kill now
            return 0.0
        meta, spec = self.pod["metadata"], self.pod.get("spec") or {}
        g = meta.get("deletionGracePeriodSeconds")
        if g is None:
            g = spec.get("terminationGracePeriodSeconds")
        return float(30 if g is None else g)

    async def _terminate(self) -> None:
        """preStop hooks, SIGTERM, SIGKILL at the end of the grace period, delete (grace 0)."""
        deadline = time.monotonic() + self._grace_seconds()
        for t in self.tasks:
            t.cancel()
        running = [cs for cs in [*self.init, *self.containers] if cs.running]
        for cs in running:
            await self.node.events.emit(
                self.pod, "Killing", f"Stopping container {cs.name}", host=self.node.name
            )
        await asyncio.gather(
            *(self._pre_stop(cs, deadline) for cs in running), return_exceptions=True
        )
        await asyncio.gather(
            *(cs.proc.stop(deadline) for cs in running if cs.proc), return_exceptions=True
        )
        for cs in running:
            if cs.proc is not None and cs.terminated is None:
                code = cs.proc.exit_code if cs.proc.exit_code is not None else 137
                cs.terminated = {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": cs.proc.started_at,
                    "finishedAt": cs.proc.finished_at or now(),
                    "containerID": cs.container_id(),
                }
            cs.ready = False
        if running and not self.deleted:
            await self._patch()
        await self._delete()

    async def _pre_stop(self, cs: ContainerState, deadline: float) -> None:
        hook = ((cs.spec.get("lifecycle") or {}).get("preStop")) or {}
        remaining = deadline - time.monotonic()
        if not hook or remaining <= 0 or cs.proc is None:
            return
        if "exec" in hook:
            rc = await cs.proc.exec(
                hook["exec"]["command"],
                cs.env,
                cs.spec.get("workingDir"),
                remaining,
                identity=cs.identity,
            )
            if rc != 0:
                await self.node.events.emit(
                    self.pod,
                    "FailedPreStopHook",
                    f"PreStopHook failed (exit code {rc})",
                    type_="Warning",
                    host=self.node.name,
                )
        elif "httpGet" in hook:
            await self._probe_once(cs, {"httpGet": hook["httpGet"]}, remaining)

    # -- status -----------------------------------------------------------------------------

    def _condition(
        self, type_: str, ok: bool, reason: str | None = None, message: str | None = None
    ) -> dict[str, Any]:
        value = "True" if ok else "False"
        prev = self.transitions.get(type_)
        if prev is None or prev[0] != value:
            self.transitions[type_] = (value, now())
        c: dict[str, Any] = {
            "type": type_,
            "status": value,
            "lastProbeTime": None,
            "lastTransitionTime": self.transitions[type_][1],
        }
        if not ok and reason:
            c["reason"], c["message"] = reason, message
        return c

    def status(self) -> dict[str, Any]:
        not_ready = [cs.name for cs in self.containers if not (cs.ready and cs.running)]
        all_ready = not not_ready and self.phase == "Running"
        msg = f"containers with unready status: [{' '.join(not_ready)}]"
        scheduled = next(
            (
                c
                for c in (self.pod.get("status") or {}).get("conditions") or []
                if c.get("type") == "PodScheduled"
            ),
            {
                "type": "PodScheduled",
                "status": "True",
                "lastProbeTime": None,
                "lastTransitionTime": self.start_time,
            },
        )
        pending_init = [cs.name for cs in self.init if (cs.terminated or {}).get("exitCode") != 0]
        conditions = [
            self._condition(
                "Initialized",
                self.initialized,
                "ContainersNotInitialized",
                f"containers with incomplete status: [{' '.join(pending_init)}]",
            ),
            self._condition("Ready", all_ready, "ContainersNotReady", msg),
            self._condition("ContainersReady", all_ready, "ContainersNotReady", msg),
            scheduled,
        ]
        st: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conditions,
            "hostIP": self.node.host_ip,
            "startTime": self.start_time,
            "containerStatuses": [cs.status() for cs in self.containers],
        }
        if self.ip:
            st["podIP"], st["podIPs"] = self.ip, [{"ip": self.ip}]
        if self.init:
            st["initContainerStatuses"] = [cs.status() for cs in self.init]
        if self.phase in TERMINAL:
            for cs in self.containers:
                cs.ready = False
        return st

    async def _patch(self) -> None:
        async with self._patch_lock:  # in order: a later state never lands before an earlier one
            await self._patch_now()

    async def _patch_now(self) -> None:
        if self.deleted:
            return
        body = {"status": self.status()}
        try:
            await raw(
                self.node.core.patch_namespaced_pod_status(
                    self.name, self.ns, body, _content_type=MERGE, _preload_content=False
                )
            )
        except Exception as e:
            if status_of(e) == 404:
                self.deleted = True
                self.changed.set()
            else:
                log.warning("pod %s: status patch failed: %s", self.key, e)

    async def _status_writer(self) -> None:
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            await self._patch()


class PodManager:
    """Watches pods with spec.nodeName=<node> and keeps one PodWorker per pod."""

    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.workers: dict[str, PodWorker] = {}
        self._finished: dict[str, float] = {}

    async def run(self) -> None:
        await watch_forever(
            f"pods on {self.node.name}",
            self.node.core.list_pod_for_all_namespaces,
            self._on_event,
            resync=self._resync,
            field_selector=f"spec.nodeName={self.node.name}",
        )

    async def _resync(self, items: list[dict[str, Any]]) -> None:
        present = {p["metadata"]["uid"] for p in items}
        for uid, w in list(self.workers.items()):
            if uid not in present:
                w.gone()

    async def _on_event(self, type_: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        w = self.workers.get(uid)
        if type_ == "DELETED":
            if w is not None:
                w.gone()
            return
        if w is not None:
            w.update(pod)
            return
        if uid in self._finished:
            return
        w = PodWorker(self.node, pod)
        self.workers[uid] = w
        w.task = asyncio.create_task(w.run())
        w.task.add_done_callback(lambda _t, uid=uid: self._done(uid))

    def _done(self, uid: str) -> None:
        self.workers.pop(uid, None)
        t = time.monotonic()
        self._finished[uid] = t
        for k, v in list(self._finished.items()):
            if t - v > 600:
                del self._finished[k]

    def pods(self) -> list[dict[str, Any]]:
        return [
            {
                "pod": w.key,
                "phase": w.phase,
                "ip": w.ip,
                "pids": [cs.proc.init_pid for cs in w.containers if cs.proc and cs.running],
            }
            for w in self.workers.values()
        ]

    async def kill_all(self) -> None:
        """Node failure: kill every pod's processes at once, tell the API nothing."""
        workers = list(self.workers.values())
        for w in workers:
            if w.task is not None:
                w.task.cancel()
        await asyncio.gather(*(w.task for w in workers if w.task), return_exceptions=True)
        self.workers.clear()
        self._finished.clear()
