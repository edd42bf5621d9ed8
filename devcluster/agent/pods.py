"""Running the pods bound to one node as local processes, and reporting them as a kubelet does.

Per pod a PodWorker: volumes -> init containers, sidecars among them (`sidecars`) -> containers
(one launcher each, see runtime.py) -> status patches (Pending/Running/Succeeded/Failed,
conditions, containerStatuses) -> on deletion preStop, SIGTERM (main containers first, then the
sidecars in reverse order), SIGKILL after the grace period, then delete with gracePeriodSeconds=0.

Differences from a kubelet (documented in the package README): images are ignored (command + args
run on the host; the "image's user" is the agent's), securityContext is applied as far as
`podsecurity` says (uid, gids, fsGroup, runAsNonRoot, no_new_privs, capabilities; no seccomp),
liveness probes are ignored, startup and readiness probes (httpGet, tcpSocket, exec) are run.

Here the lifecycle (start, loss after a node restart, termination, deletion) and the per-node
watch; the pod's state and status patches are in `podstate`, its containers in `containers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from typing import Any

from . import sidecars
from .containers import ContainerRunner
from .kube import log, now, raw, status_of, watch_forever
from .podstate import TERMINAL, ContainerState, NodeContext


class PodWorker(ContainerRunner):
    """One pod bound to this node, from its first status patch to its deletion."""

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
            self._restore_init(status, rerun=True)
            self.initialized = True
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
            if cs.terminated is not None and not cs.sidecar:
                continue  # completed before the agent lost the pod (_restore_init)
            if cs.sidecar:
                ok = await self._start_sidecar(cs, volumes)
            else:
                ok = await self._run_init(cs, volumes)
            if ok is None:  # deleted meanwhile
                await self._terminate()
                return
            if not ok:
                # the pod failed: the sidecars started before are stopped, and only then is
                # the phase terminal (the kubelet reports no terminal phase while any runs)
                await self._stop_ordered(self._grace_seconds())
                self.phase = "Failed"
                await self._patch()
                await self._finish()
                return
        self.initialized = True
        mains = [asyncio.create_task(self._supervise(cs, volumes)) for cs in self.containers]
        self.tasks += mains
        done = asyncio.gather(*mains)
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
        # the main containers ended for good (restartPolicy Never/OnFailure): the pod completes,
        # its sidecars are stopped as at a deletion, and its phase is the main containers' alone
        await self._stop_ordered(self._grace_seconds())
        self.phase = sidecars.terminal_phase([cs.status() for cs in self.containers])
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

    def _restore_init(self, status: dict[str, Any], *, rerun: bool) -> None:
        """The init containers of a pod whose processes the agent lost (its node stopped) after
        its main containers had started: regular ones keep their outcome, they are not run
        again; sidecars lost their run like the main containers, and run again (counted) with
        `rerun`, else are reported lost."""
        prev_of = {s["name"]: s for s in status.get("initContainerStatuses") or []}
        for cs in self.init:
            prev = prev_of.get(cs.name, {})
            if cs.sidecar and rerun:
                cs.restart_count = int(prev.get("restartCount", 0)) + 1
                cs.last_state = self._lost_state(prev)
            elif cs.sidecar:
                cs.restart_count = int(prev.get("restartCount", 0))
                cs.terminated = self._lost_state(prev)["terminated"]
            else:
                cs.terminated = (prev.get("state") or {}).get("terminated") or {
                    "exitCode": 0,
                    "reason": "Completed",
                    "startedAt": None,
                    "finishedAt": now(),
                }

    async def _report_lost(self, status: dict[str, Any]) -> None:
        self._restore_init(status, rerun=False)
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
        if self.node.netpol is not None and self.in_policy:
            with contextlib.suppress(RuntimeError):
                await self.node.netpol.leave(self.uid)
            self.in_policy = False
        if self.node.network is not None and self.network_made and self.ip:
            with contextlib.suppress(RuntimeError):
                await self.node.network.detach(self.ip)
            self.netns, self.network_made = None, False
        self.node.ips.release(self.ip)
        self.node.devices.release(self.uid)
        if self.deleted:
            shutil.rmtree(self.dir, ignore_errors=True)

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
        """preStop hooks, SIGTERM in the kubelet's order, SIGKILL at the end of the grace
        period, delete (grace 0)."""
        await self._stop_ordered(self._grace_seconds())
        await self._delete()

    async def _stop_ordered(self, grace: float) -> None:
        """Stop every running container within `grace` seconds as the kubelet's killPod does:
        each one's preStop hook at once, then SIGTERM to the main (and a running regular init)
        containers, to each sidecar only once all main containers and the sidecar declared
        after it have exited (`sidecars.stop_prerequisites`); SIGKILL at the deadline, but
        never sooner than MIN_STOP_WINDOW_SECONDS after a container's own SIGTERM while the
        pod has a grace period. Supervisors are cancelled first: nothing restarts."""
        deadline = time.monotonic() + grace
        for t in self.tasks:
            t.cancel()
        running = [cs for cs in [*self.init, *self.containers] if cs.running]
        for cs in running:
            await self.node.events.emit(
                self.pod, "Killing", f"Stopping container {cs.name}", host=self.node.name
            )
        prereqs = sidecars.stop_prerequisites(
            [cs.spec for cs in self.init],
            [cs.spec for cs in self.containers],
            {cs.name for cs in running},
        )
        exited = {cs.name: asyncio.Event() for cs in running}

        async def stop(cs: ContainerState) -> None:
            try:
                await self._pre_stop(cs, deadline)
                for name in prereqs.get(cs.name, []):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(exited[name].wait(), left)
                if cs.proc is not None:
                    end = deadline
                    if grace > 0:
                        end = max(end, time.monotonic() + sidecars.MIN_STOP_WINDOW_SECONDS)
                    await cs.proc.stop(end)
            finally:
                exited[cs.name].set()

        await asyncio.gather(*(stop(cs) for cs in running), return_exceptions=True)
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
            cs.ready = cs.started = False
        if running and not self.deleted:
            await self._patch()

    async def _pre_stop(self, cs: ContainerState, deadline: float) -> None:
        hook = ((cs.spec.get("lifecycle") or {}).get("preStop")) or {}
        remaining = deadline - time.monotonic()
        if not hook or remaining <= 0 or cs.proc is None:
            return
        if "exec" in hook:
            rc = await cs.proc.exec(
                hook["exec"]["command"],
                cs.env,
                cs.working_dir,
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

    def find(self, namespace: str, name: str) -> PodWorker | None:
        """The worker of the pod namespace/name on this node (the newest, if a pod of that name
        was recreated while the old one still stops)."""
        found = [w for w in self.workers.values() if (w.ns, w.name) == (namespace, name)]
        return next((w for w in reversed(found) if not w.deleting), found[-1] if found else None)

    def pods(self) -> list[dict[str, Any]]:
        return [
            {
                "pod": w.key,
                "phase": w.phase,
                "ip": w.ip,
                "pids": [
                    cs.proc.init_pid for cs in [*w.init, *w.containers] if cs.proc and cs.running
                ],
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
