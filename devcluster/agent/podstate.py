"""A pod's state on its node and its status as a kubelet reports it.

What a node's pod workers share (`NodeContext`, the pod address pool), each container's state, and
`PodState`: the pod object as last seen, what changed, and the status patches (phase, conditions,
containerStatuses) written in order. `containers.ContainerRunner` starts and supervises the
containers on top of it; `pods.PodWorker` runs the pod's lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from . import podsecurity, sidecars
from .devices import Devices
from .kube import MERGE, Events, log, now, raw, status_of
from .netpolicy import Enforcer
from .podnet import PodNetwork
from .runtime import ContainerProcess, HostPaths
from .serviceenv import ServiceLister

TERMINAL = ("Succeeded", "Failed")


class IPPool:
    """Addresses for one node's pods (its podCIDR PREFIX.0/24): PREFIX.2 .. PREFIX.254, reused
    round-robin (PREFIX.1 is the node's)."""

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
    #: the pods' network namespaces and veths (None: unit tests without one)
    network: PodNetwork | None = None
    #: the cluster DNS server's address (None: none runs; pods keep the host's resolv.conf)
    dns_server: str | None = None
    #: the Services whose variables containers get (None: unit tests without one)
    services: ServiceLister | None = None


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
    #: the process's working directory (workingDir, else the runtime's default); execs start there
    working_dir: str | None = None
    #: this run has started: its startupProbe passed, or it runs and has none (`probes`)
    started: bool = False

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def sidecar(self) -> bool:
        """An init container with restartPolicy Always (`sidecars`)."""
        return self.init and sidecars.is_sidecar(self.spec)

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
        if self.init and not self.sidecar:
            # the kubelet's prober reports a regular init container ready once it exited 0
            ready = (self.terminated or {}).get("exitCode") == 0
        else:
            ready = self.ready and self.started and self.running
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image") or "",
            "imageID": "",
            "ready": ready,
            "restartCount": self.restart_count,
            "started": self.started and self.running,
            "state": self.state(),
            "lastState": self.last_state,
        }
        if self.proc is not None and self.proc.started_at:
            out["containerID"] = self.container_id()
        return out


class PodState:
    """One pod as its worker knows it: the object, its containers, and the status it reports."""

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
        self.netns: Path | None = None  # the pod's network namespace (its containers enter it)
        self.network_made = False  # the namespace and veth were (maybe partly) made
        self.in_policy = False  # the NetworkPolicy table covers the pod
        self.task: asyncio.Task[Any] | None = None

    # -- inputs -----------------------------------------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.changed.set()
        if self.node.netpol is not None and self.in_policy:
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
        statuses = [cs.status() for cs in self.containers]
        init_statuses = [cs.status() for cs in self.init]
        init_specs = [cs.spec for cs in self.init]
        # sidecars' readiness counts as the main containers' does (generate.go)
        not_ready = sidecars.unready(init_specs, init_statuses, statuses)
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
        # once set, `initialized` stays True while a sidecar restarts (the kubelet: any main
        # container has started); until then the message names what is missing
        pending_init = sidecars.incomplete_init(init_specs, init_statuses)
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
            "containerStatuses": statuses,
        }
        if self.ip:
            st["podIP"], st["podIPs"] = self.ip, [{"ip": self.ip}]
        if self.init:
            st["initContainerStatuses"] = init_statuses
        if self.phase in TERMINAL:
            for cs in [*self.init, *self.containers]:
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
