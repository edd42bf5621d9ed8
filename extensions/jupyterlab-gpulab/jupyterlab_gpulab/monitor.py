"""GPUMonitor: the configuration, and the wiring of source, sampler, rules and panels."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

from traitlets import Bool, Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Configurable

from gpulab.spawner.names import MONITOR_SOURCE_ENV, SIMULATED_GPU_FILE_ENV

from .fanout import Fanout, Subscriber, clamp_rate
from .lag import LoopLagMeter
from .metrics import GPUCollector, exposition, make_registry
from .push import PUSH_INTERVAL_ENV, PUSH_URL_ENV, MetricsPusher, push_settings_from_env
from .rules import RuleBook
from .sampler import MIN_PERIOD_SECONDS, Sample, Sampler
from .share import Share, share_from_env
from .sources import Latencies, Source, select_source

log = logging.getLogger(__name__)

SOURCES = ("auto", "nvml", "simulated", "none")
IDLE_GPU_RULE = 'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU")'


class GPUMonitor(Configurable):
    """GPU figures for this server's share: one sampler thread, a history, alerts, metrics."""

    source = Unicode(
        "auto",
        config=True,
        help="""Where GPU figures come from: 'auto' (NVML if the driver initialises, else none),
        'nvml', 'simulated' (labelled fake devices with realistic NVML call costs, for demos and
        tests) or 'none'. Defaults to $GPULAB_MONITOR_SOURCE when set.""",
    )

    @default("source")
    def _default_source(self) -> str:
        return os.environ.get(MONITOR_SOURCE_ENV, "auto") or "auto"

    @validate("source")
    def _validate_source(self, proposal: Any) -> str:
        value = str(proposal["value"]).strip().lower()
        if value not in SOURCES:
            raise TraitError(
                f"GPUMonitor.source={proposal['value']!r} is not one of {', '.join(SOURCES)}"
            )
        return value

    period_seconds = Float(
        1.0,
        config=True,
        help=f"""Seconds between two samples of every device (minimum {MIN_PERIOD_SECONDS}). One
        sampler serves every panel: a client asking for a faster rate gets one push per sample.""",
    )

    @validate("period_seconds")
    def _validate_period(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if value < MIN_PERIOD_SECONDS:
            raise TraitError(
                f"GPUMonitor.period_seconds={value} is below the minimum {MIN_PERIOD_SECONDS} s"
            )
        return value

    process_list_seconds = Float(
        5.0,
        config=True,
        help="""Seconds between two reads of a whole GPU's or MIG slice's process list, the
        slowest NVML query per device (milliseconds where the others take microseconds). Those
        devices report memory and utilisation from the device every sample; the list only names
        the processes, which change rarely. A fraction of a shared GPU reads its list every sample,
        because its memory is counted from its own processes. 0 reads every list every sample.""",
    )

    @validate("process_list_seconds")
    def _validate_process_list_seconds(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value >= 0:  # NaN too
            raise TraitError(f"GPUMonitor.process_list_seconds={value} must be 0 or more")
        return value

    history_seconds = Float(
        1800.0,
        config=True,
        help="Seconds of samples kept in memory for chart backfill (GET gpulab/monitor/samples).",
    )

    @validate("history_seconds")
    def _validate_history(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if value <= 0:
            raise TraitError(f"GPUMonitor.history_seconds={value} must be positive")
        return value

    max_clients = Integer(
        100,
        config=True,
        help="Most websocket panels connected at once; further connections get 503.",
    )

    default_rules = List(
        Unicode(),
        [IDLE_GPU_RULE],
        config=True,
        help="""Alert rules every user has, in gpulab's rule language; users add their own, kept in
        rules_file. Users cannot delete these.""",
    )

    rules_file = Unicode(
        config=True,
        help="The user's own alert rules, one per line (default ~/.gpulab/alert-rules.txt).",
    )

    @default("rules_file")
    def _default_rules_file(self) -> str:
        return str(Path.home() / ".gpulab" / "alert-rules.txt")

    recent_alerts = Integer(
        100, config=True, help="Alert transitions kept for GET gpulab/monitor/alerts."
    )

    simulated_device_count = Integer(
        1,
        config=True,
        help="Simulated GPUs to show when GPULAB_GPU_UUIDS is empty (source 'simulated' only).",
    )

    simulated_latencies = Dict(
        value_trait=Float(),
        config=True,
        help="""Seconds each simulated NVML call takes, by call: utilization (default 2.5e-6),
        memory (12e-6), processes (4.5e-3), temperature, power (0). Waits under 200 us spin;
        longer ones sleep and release the GIL, as a real ctypes call into the driver does.""",
    )

    @validate("simulated_latencies")
    def _validate_latencies(self, proposal: Any) -> dict[str, float]:
        try:
            Latencies.from_mapping(proposal["value"])
        except (TypeError, ValueError) as e:
            raise TraitError(f"GPUMonitor.simulated_latencies: {e}") from None
        return dict(proposal["value"])

    simulated_file = Unicode(
        config=True,
        help="""JSON file scripting simulated figures: {"<uuid>" or "*": {"utilization_pct": 97,
        "memory_used_mib": ..., "temperature_c": ..., "power_w": ..., "processes": [...]}}.
        Re-read whenever it changes. Defaults to $GPULAB_SIMULATED_GPU_FILE.""",
    )

    @default("simulated_file")
    def _default_simulated_file(self) -> str:
        return os.environ.get(SIMULATED_GPU_FILE_ENV, "")

    measure_loop_lag = Bool(
        False,
        config=True,
        help="""Measure the server's event-loop lag every 10 ms and serve it at
        GET gpulab/monitor/lag (for benchmarks; off in production).""",
    )

    push_url = Unicode(
        config=True,
        help=f"""Where this server pushes its Prometheus metrics (the hub's gpulab-metrics
        service, POST <push_url>/<user>[/<server>]); empty: no push. Defaults to ${PUSH_URL_ENV},
        which the hub sets for every server.""",
    )

    @default("push_url")
    def _default_push_url(self) -> str:
        return os.environ.get(PUSH_URL_ENV, "").strip()

    push_interval_seconds = Float(
        config=True,
        help=f"""Seconds between two pushes to push_url. Defaults to ${PUSH_INTERVAL_ENV}, which
        the hub sets to the cadence its service expects (15).""",
    )

    @default("push_interval_seconds")
    def _default_push_interval(self) -> float:
        try:
            return push_settings_from_env()[1]
        except ValueError as e:
            raise TraitError(f"GPUMonitor.push_interval_seconds: {e}") from None

    @validate("push_interval_seconds")
    def _validate_push_interval(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise TraitError(f"GPUMonitor.push_interval_seconds={value} must be positive")
        return value

    # -- runtime -------------------------------------------------------------------------------

    def __init__(self, share: Share | None = None, src: Source | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.share = share or share_from_env()
        self.device_source = src or select_source(
            self.source,
            self.share,
            simulated_device_count=self.simulated_device_count,
            latencies=Latencies.from_mapping(self.simulated_latencies),
            script_path=self.simulated_file or None,
            process_list_seconds=self.process_list_seconds,
        )
        self.fanout = Fanout()
        self.rules = RuleBook(Path(self.rules_file), self.default_rules, self.recent_alerts)
        self.sampler = Sampler(
            self.device_source, self.period_seconds, self.history_seconds, self._on_sample
        )
        self.lag = LoopLagMeter() if self.measure_loop_lag else None
        self.pusher: MetricsPusher | None = None
        self.registry = make_registry(
            GPUCollector(
                self.share.user,
                self.share.server,
                self.sampler.latest,
                self.rules.active,
                lambda: self.device_source.simulated,
            )
        )

    @property
    def max_rate_hz(self) -> float:
        return 1.0 / self.period_seconds

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        if self.device_source.devices():
            self.sampler.start(loop)
        if self.lag is not None:
            self.lag.start(loop)
        self._start_push(loop)
        log.info(
            "gpulab monitor: %s source, %d device(s), sampling every %.2f s for %s/%s",
            self.device_source.kind,
            len(self.device_source.devices()),
            self.period_seconds,
            self.share.user,
            self.share.server or "(default)",
        )

    def _start_push(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.push_url:
            return  # no hub service to report to (a server started outside JupyterHub)
        # the server's own hub token, and only to the hub's service: see push.py for why no
        # other tenant can use it
        token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        if not token or not self.share.user:
            log.warning(
                "gpulab monitor: not pushing metrics to %s: $JUPYTERHUB_API_TOKEN or"
                " $JUPYTERHUB_USER is not set (is this server started by JupyterHub?)",
                self.push_url,
            )
            return
        self.pusher = MetricsPusher(
            self.push_url,
            token,
            self.share.user,
            self.share.server,
            self.metrics_text,
            self.push_interval_seconds,
        )
        self.pusher.start(loop)

    def stop(self) -> None:
        if self.pusher is not None:
            self.pusher.stop()
        self.sampler.stop()
        if self.lag is not None:
            self.lag.stop()
        self.device_source.close()

    def _on_sample(self, sample: Sample) -> None:
        """On the loop: evaluate the rules, push the sample and any alert transitions."""
        events = self.rules.observe(sample)
        alerts = [json.dumps({"type": "alert", "event": e}) for e in events]
        self.fanout.publish_sample(sample.t, sample.message, alerts)

    def broadcast_alert(self, event: dict[str, Any]) -> None:
        self.fanout.broadcast(json.dumps({"type": "alert", "event": event}))

    # -- payloads ------------------------------------------------------------------------------

    def devices_payload(self) -> dict[str, Any]:
        src = self.device_source
        message = src.message
        if self.share.fraction is not None and src.devices():
            message = (message + "; " if message else "") + (
                "Shared GPU: utilisation is the whole device's unless a sample says own_processes"
            )
        return {
            "source": src.kind,
            "simulated": src.simulated,
            "message": message,
            "period_seconds": self.period_seconds,
            "max_rate_hz": self.max_rate_hz,
            "share": self.share.to_json(),
            "devices": [d.to_json() for d in src.devices()],
        }

    def subscribe(self, send: Any, requested_hz: float | None) -> Subscriber:
        sub = Subscriber(send, clamp_rate(requested_hz, self.period_seconds), self.period_seconds)
        self.fanout.add(sub)
        return sub

    def stats(self) -> dict[str, Any]:
        s = self.sampler
        return {
            "source": self.device_source.kind,
            "devices": len(self.device_source.devices()),
            "period_seconds": self.period_seconds,
            "samples_taken": s.samples_taken,
            "sampling_errors": s.errors,
            "history_length": len(s.history()),
            "history_capacity": s.capacity,
            "sampler_cpu_seconds": s.cpu_seconds,
            "sampler_wall_seconds": s.wall_seconds,
            "source_calls": self.device_source.call_counts(),
            "clients": len(self.fanout),
            "push": None
            if self.pusher is None
            else {
                "url": self.pusher.url,
                "interval_seconds": self.pusher.interval_seconds,
                "pushes": self.pusher.pushes,
                "failures": self.pusher.failures,
                "error": self.pusher.error,
                "last_push": self.pusher.last_push,
            },
        }

    def metrics_text(self) -> bytes:
        return exposition(self.registry)
