"""Probes of a pod's containers, as the kubelet's prober runs them: startup probes (a container
counts as started once its startupProbe passed, or at once without one; it is killed and, as its
policy says, restarted when it fails failureThreshold times), then readiness probes, which start
only once the container has started (httpGet, tcpSocket, exec). Liveness probes are not run.

Sidecars (`sidecars.is_sidecar`) are probed like main containers: their start lets the pod's
initialization move on, their readiness counts in the pod's Ready condition. Regular init
containers have no probes (the API refuses them there).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

import aiohttp

from .podstate import ContainerState, PodState

PROBE_KINDS = ("httpGet", "tcpSocket", "exec")


def _usable(probe: dict[str, Any] | None) -> dict[str, Any] | None:
    """The probe if it names a handler the agent runs; others (grpc) are ignored, so the
    container counts as started and ready as if it had none."""
    return probe if probe and any(k in probe for k in PROBE_KINDS) else None


class Prober(PodState):
    """A pod's probes on top of its state; `containers.ContainerRunner` starts them with each run."""

    def _begin_probes(self, cs: ContainerState) -> None:
        """Called once a run of the container has started: its startup probe, or its start."""
        startup = _usable(cs.spec.get("startupProbe"))
        if startup is not None:
            self.tasks.append(asyncio.create_task(self._startup_loop(cs, startup)))
        else:
            self._on_started(cs)

    def _on_started(self, cs: ContainerState) -> None:
        cs.started = True
        readiness = _usable(cs.spec.get("readinessProbe"))
        if readiness is not None:
            self.tasks.append(asyncio.create_task(self._probe_loop(cs, readiness)))
        else:
            cs.ready = True
        self.dirty.set()
        self.changed.set()  # an init sequence waiting for this sidecar to start goes on

    async def _startup_loop(self, cs: ContainerState, probe: dict[str, Any]) -> None:
        proc = cs.proc
        await asyncio.sleep(float(probe.get("initialDelaySeconds") or 0))
        period = float(probe.get("periodSeconds") or 10)
        timeout = float(probe.get("timeoutSeconds") or 1)
        need_fail = int(probe.get("failureThreshold") or 3)
        failures = 0
        while cs.running and cs.proc is proc:
            if await self._probe_once(cs, probe, timeout):
                self._on_started(cs)
                return
            failures += 1
            if failures >= need_fail and proc is not None:
                await self.node.events.emit(
                    self.pod,
                    "Unhealthy",
                    "Startup probe failed",
                    type_="Warning",
                    host=self.node.name,
                )
                await self.node.events.emit(
                    self.pod,
                    "Killing",
                    f"Container {cs.name} failed startup probe, will be restarted",
                    host=self.node.name,
                )
                # the probe's own grace period where it sets one, else the pod's (as the kubelet)
                grace = probe.get("terminationGracePeriodSeconds")
                if grace is None:
                    grace = (self.pod.get("spec") or {}).get("terminationGracePeriodSeconds")
                await proc.stop(time.monotonic() + float(30 if grace is None else grace))
                return  # its supervisor sees the exit and restarts it as its policy says
            await asyncio.sleep(period)

    # -- readiness --------------------------------------------------------------------------

    async def _probe_loop(self, cs: ContainerState, probe: dict[str, Any]) -> None:
        proc = cs.proc  # one run's probe: a restarted container gets a loop of its own
        await asyncio.sleep(float(probe.get("initialDelaySeconds") or 0))
        period = float(probe.get("periodSeconds") or 10)
        timeout = float(probe.get("timeoutSeconds") or 1)
        need_ok, need_fail = (
            int(probe.get("successThreshold") or 1),
            int(probe.get("failureThreshold") or 3),
        )
        ok_run = fail_run = 0
        while cs.running and cs.proc is proc:
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
                rc = await cs.proc.exec(
                    probe["exec"]["command"],
                    cs.env,
                    cs.working_dir,
                    timeout,
                    identity=cs.identity,
                )
                return rc == 0
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            return False
        return False
