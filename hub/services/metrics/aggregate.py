"""The latest push of every running server, and the admin's alert rules evaluated over them."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from gpulab.hub.alerts import AlertEvent, Rule, RuleEngine
from gpulab.hub.services.metrics.listing import Target
from gpulab.hub.services.metrics.push import PushResult

log = logging.getLogger("gpulab.metrics")


@dataclass
class ServerState:
    target: Target
    first_seen: float  # when the hub's listing (or a verified push) first showed it
    up: bool = False
    error: str = ""
    last_push: float | None = None
    result: PushResult | None = None  # the latest accepted push
    pushes: int = 0


@dataclass
class Aggregate:
    """State of the gpulab-metrics service; loop-side only (not thread-safe)."""

    rules: list[Rule]
    idle_alert: str = "IDLE_GPU"
    max_gap_seconds: float | None = None
    recent_events: int = 200
    servers: dict[str, ServerState] = field(default_factory=dict)
    engine: RuleEngine = field(init=False)
    recent: deque[dict[str, Any]] = field(init=False)
    # device key "user/server/gpu" -> (user, server, gpu); names may hold '/' in theory
    devices: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    cycles: int = 0
    pushes_total: int = 0
    push_refusals_total: int = 0
    last_cycle: float | None = None
    last_cycle_seconds: float = 0.0
    hub_error: str = ""
    config_error: str = ""  # the service's config did not load (it runs on defaults)

    def __post_init__(self) -> None:
        self.engine = RuleEngine(self.rules, max_gap_seconds=self.max_gap_seconds)
        self.recent = deque(maxlen=self.recent_events)

    @staticmethod
    def device_key(user: str, server: str, gpu: str) -> str:
        return f"{user}/{server}/{gpu}"

    # -- updates -------------------------------------------------------------------------------

    def set_targets(self, targets: Iterable[Target], t: float) -> list[AlertEvent]:
        """The servers running now; those gone are dropped and their alerts resolve."""
        wanted = {target.key: target for target in targets}
        events: list[AlertEvent] = []
        for key in [k for k in self.servers if k not in wanted]:
            gone = self.servers.pop(key)
            events += self._forget_gpus(gone.target, keep=set(), t=t)
        for key, target in wanted.items():
            self.servers.setdefault(key, ServerState(target, first_seen=t))
        return self._record(events)

    def add_target(self, target: Target, t: float) -> None:
        """One server the hub says runs, learnt between two listings (its first push)."""
        self.servers.setdefault(target.key, ServerState(target, first_seen=t))

    def add_push(self, result: PushResult) -> list[AlertEvent]:
        """One accepted push: its figures are current and fed to the rules."""
        state = self.servers.get(result.target.key)
        if state is None:  # the server stopped while its push was parsed
            return []
        if state.error:
            log.info("gpulab-metrics: %s pushes again", result.target.key)
        state.up, state.error, state.last_push, state.result = True, "", result.t, result
        state.pushes += 1
        self.pushes_total += 1
        target = result.target
        events = self._forget_gpus(target, keep=set(result.gpus), t=result.t)
        for gpu, sample in result.gpus.items():
            key = self.device_key(target.user, target.server, gpu)
            self.devices[key] = (target.user, target.server, gpu)
            events += self.engine.observe(key, sample)
        return self._record(events)

    def expire(self, t: float, stale_after_seconds: float) -> None:
        """Servers that have not pushed for stale_after_seconds are down: their figures leave the
        exposition (a server that does not report has no current figures)."""
        for state in self.servers.values():
            since = state.last_push if state.last_push is not None else state.first_seen
            if t - since <= stale_after_seconds:
                continue
            if state.last_push is None:
                error = (
                    f"no push in {t - since:.0f} s since it started (is jupyterlab-gpulab"
                    " installed in the server's environment, and can it reach the service?)"
                )
            else:
                error = f"no push for {t - since:.0f} s"
            if not state.error:  # once per outage, not every cycle
                log.warning("gpulab-metrics: %s: %s", state.target.key, error)
            state.up, state.error = False, error

    def _forget_gpus(self, target: Target, keep: set[str], t: float) -> list[AlertEvent]:
        events: list[AlertEvent] = []
        for key, (user, server, gpu) in list(self.devices.items()):
            if (user, server) == (target.user, target.server) and gpu not in keep:
                del self.devices[key]
                events += self.engine.forget(key, t)
        return events

    def _record(self, events: list[AlertEvent]) -> list[AlertEvent]:
        for e in events:
            self.recent.append(self.event_json(e))
            log.info("gpulab-metrics: alert %s %s on %s (%s)", e.rule, e.state, e.device, e.message)
        return events

    # -- reading -------------------------------------------------------------------------------

    def event_json(self, event: AlertEvent) -> dict[str, Any]:
        body = asdict(event)
        user, server, gpu = self.devices.get(event.device, ("", "", ""))
        if not user:
            user, _, rest = event.device.partition("/")
            server, _, gpu = rest.partition("/")
        body.update(user=user, server=server, gpu=gpu)
        return body

    def active(self) -> list[dict[str, Any]]:
        return [self.event_json(e) for e in self.engine.active()]

    def idle_gpu_servers(self) -> list[dict[str, Any]]:
        """Servers every GPU of which has the idle alert firing (what GPU-aware culling uses)."""
        firing: dict[str, AlertEvent] = {
            e.device: e for e in self.engine.active() if e.rule == self.idle_alert
        }
        out = []
        for state in self.servers.values():
            if not state.up or state.result is None or not state.result.gpus:
                continue
            target = state.target
            keys = [self.device_key(target.user, target.server, g) for g in state.result.gpus]
            if all(k in firing for k in keys):
                out.append(
                    {
                        "user": target.user,
                        "server": target.server,
                        "gpus": sorted(state.result.gpus),
                        "since": max(firing[k].since for k in keys),
                    }
                )
        return out

    def alerts_payload(self) -> dict[str, Any]:
        return {
            "alerts": self.active(),
            "idle_alert": self.idle_alert,
            "idle_gpu_servers": self.idle_gpu_servers(),
            "rules": [r.to_text() for r in self.rules],
            "recent": list(self.recent),
            "config_error": self.config_error,
        }

    def servers_payload(self) -> dict[str, Any]:
        active = self.active()
        servers = []
        for state in sorted(self.servers.values(), key=lambda s: s.target.key):
            target = state.target
            gpus = []
            if state.result is not None:
                for gpu, s in sorted(state.result.gpus.items()):
                    gpus.append(
                        {
                            "gpu": gpu,
                            "utilization_pct": s.utilization_pct,
                            "memory_used_mib": s.memory_used_mib,
                            "memory_limit_mib": s.memory_limit_mib,
                            "temperature_c": s.temperature_c,
                            "power_w": s.power_w,
                            "t": s.t,
                        }
                    )
            servers.append(
                {
                    "user": target.user,
                    "server": target.server,
                    "up": state.up,
                    "error": state.error,
                    "last_push": state.last_push,
                    "pushes": state.pushes,
                    "gpus": gpus,
                    "alerts": [
                        a
                        for a in active
                        if (a["user"], a["server"]) == (target.user, target.server)
                    ],
                }
            )
        return {
            "servers": servers,
            "cycles": self.cycles,
            "last_cycle": self.last_cycle,
            "pushes_total": self.pushes_total,
            "push_refusals_total": self.push_refusals_total,
            "hub_error": self.hub_error,
            "config_error": self.config_error,
        }
