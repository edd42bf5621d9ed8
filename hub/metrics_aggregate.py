"""The latest scrape of every running server, and the admin's alert rules evaluated over them."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from gpulab.hub.alerts import AlertEvent, Rule, RuleEngine

from .metrics_scrape import ScrapeResult, Target

log = logging.getLogger("gpulab.metrics")


@dataclass
class ServerState:
    target: Target
    up: bool = False
    error: str = ""
    last_attempt: float | None = None
    last_success: float | None = None
    duration_seconds: float = 0.0
    result: ScrapeResult | None = None  # the latest successful scrape
    scrapes: int = 0
    failures: int = 0


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
    scrape_failures_total: int = 0
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
            state = self.servers.get(key)
            if state is None:
                self.servers[key] = ServerState(target)
            elif state.target != target:
                state.target = target
        return self._record(events)

    def add_result(self, result: ScrapeResult) -> list[AlertEvent]:
        """One scrape's outcome: the figures of a success are fed to the rules."""
        state = self.servers.get(result.target.key)
        if state is None:  # the server went away while we scraped it
            return []
        state.last_attempt, state.duration_seconds = result.t, result.duration_seconds
        state.scrapes += 1
        if not result.ok:
            if result.error != state.error:  # once per change, not every cycle
                log.warning(
                    "gpulab-metrics: scraping %s failed: %s", result.target.key, result.error
                )
            state.up, state.error = False, result.error
            state.failures += 1
            self.scrape_failures_total += 1
            return []
        if state.error:
            log.info("gpulab-metrics: scraping %s works again", result.target.key)
        state.up, state.error, state.last_success, state.result = True, "", result.t, result
        target = result.target
        events = self._forget_gpus(target, keep=set(result.gpus), t=result.t)
        for gpu, sample in result.gpus.items():
            key = self.device_key(target.user, target.server, gpu)
            self.devices[key] = (target.user, target.server, gpu)
            events += self.engine.observe(key, sample)
        return self._record(events)

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
                    "url": target.url,
                    "up": state.up,
                    "error": state.error,
                    "last_attempt": state.last_attempt,
                    "last_success": state.last_success,
                    "scrape_duration_seconds": state.duration_seconds,
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
            "hub_error": self.hub_error,
            "config_error": self.config_error,
        }
