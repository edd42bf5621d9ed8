"""Alert rules of one user: defaults from config plus the user's own, kept in their home.

A thin adapter over gpulab's pure rule language (gpulab.hub.alerts): parsing, evaluation and the
Prometheus form are all there. Each rule gets its own engine, so adding or deleting one rule
never resets the FOR timers of the others.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sampler import Sample

log = logging.getLogger(__name__)

FILE_HEADER = "# gpulab alert rules, one per line (the GPU panel edits this file)\n"
EVENT_FIELDS = ("rule", "severity", "message", "device", "state", "since", "t")


class RuleRejected(Exception):
    """A rule that does not parse, with where: the API answers 400 with these fields."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column

    def to_json(self) -> dict[str, Any]:
        return {"message": self.message, "line": self.line, "column": self.column}


def _alerts() -> Any:
    from gpulab.hub import alerts  # imported late: only rule features need it

    return alerts


def event_json(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        return {k: event.get(k) for k in EVENT_FIELDS}
    return {k: getattr(event, k, None) for k in EVENT_FIELDS}


def rule_id(text: str, source: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{'d' if source == 'default' else 'u'}-{digest}"


@dataclass
class RuleEntry:
    id: str
    rule: Any  # gpulab.hub.alerts.Rule
    source: str  # "user" | "default"
    engine: Any  # RuleEngine([rule])

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "text": self.rule.to_text(),
            "name": self.rule.name,
            "severity": self.rule.severity,
            "source": self.source,
        }


class RuleBook:
    """Rules, their engines and recent alert events; loop-side (not thread-safe)."""

    def __init__(self, path: Path, default_rules: Iterable[str], recent: int = 100) -> None:
        self.path = Path(path)
        self.entries: dict[str, RuleEntry] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self.error = ""
        try:
            self.alerts = _alerts()
        except ImportError as e:
            self.alerts = None
            self.error = (
                f"Alert rules are unavailable: gpulab's rule language is not installed ({e})"
            )
            log.warning("gpulab monitor: %s", self.error)
            return
        for text in default_rules:
            try:
                self._add(self._parse(text), "default")
            except RuleRejected as e:
                self.error = f"GPUMonitor.default_rules: {text!r} is not a valid rule: {e.message}"
                log.warning("gpulab monitor: %s", self.error)
        self._load_user_rules()

    # -- parsing and storage -------------------------------------------------------------------

    def _parse(self, text: str) -> Any:
        if self.alerts is None:
            raise RuleRejected(self.error)
        try:
            return self.alerts.parse_rule(text)
        except self.alerts.RuleError as e:
            raise RuleRejected(e.message, e.line, e.column) from None

    def _add(self, rule: Any, source: str) -> RuleEntry:
        rid = rule_id(rule.to_text(), source)
        if rid not in self.entries:
            self.entries[rid] = RuleEntry(rid, rule, source, self.alerts.RuleEngine([rule]))
        return self.entries[rid]

    def _load_user_rules(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as e:
            self.error = f"Cannot read your alert rules from {self.path}: {e}"
            log.warning("gpulab monitor: %s", self.error)
            return
        try:
            rules = self.alerts.parse_rules(text)
        except self.alerts.RuleError as e:
            self.error = (
                f"{self.path} line {e.line}, column {e.column}: {e.message}; "
                "fix or delete the file (the rules in it are not evaluated)"
            )
            log.warning("gpulab monitor: %s", self.error)
            return
        for rule in rules:
            self._add(rule, "user")

    def _save(self) -> None:
        user = [e.rule.to_text() for e in self.entries.values() if e.source == "user"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".alert-rules.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(FILE_HEADER + "".join(t.rstrip("\n") + "\n" for t in user))
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -- the API -------------------------------------------------------------------------------

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries.values()]

    def prometheus(self) -> dict[str, Any]:
        if self.alerts is None:
            return {}
        exported: dict[str, Any] = self.alerts.to_prometheus_rules(
            [e.rule for e in self.entries.values()]
        )
        return exported

    def add(self, text: str) -> RuleEntry:
        """Parse and keep a user rule; raises RuleRejected (and saves nothing) when invalid."""
        entry = self._add(self._parse(text), "user")
        self._save()
        return entry

    def delete(self, rid: str, t: float) -> list[dict[str, Any]]:
        """Remove a user rule; its firing alerts resolve. KeyError/PermissionError as the API says."""
        entry = self.entries.get(rid)
        if entry is None:
            raise KeyError(rid)
        if entry.source == "default":
            raise PermissionError(rid)
        del self.entries[rid]
        self._save()
        resolved = []
        for active in entry.engine.active():
            event = event_json(active)
            event.update(state="resolved", t=t, message=f"{event['message']} (rule deleted)")
            resolved.append(event)
        self.recent.extend(resolved)
        return resolved

    # -- evaluation ----------------------------------------------------------------------------

    def observe(self, sample: Sample) -> list[dict[str, Any]]:
        """Feed one sample to every rule; the alert transitions it caused."""
        if self.alerts is None or not self.entries:
            return []
        events = []
        for uuid, d in sample.devices.items():
            observed = self.alerts.Sample(
                t=sample.t,
                utilization_pct=d.utilization_pct,
                memory_used_mib=d.memory_used_mib,
                memory_limit_mib=d.memory_limit_mib,
                temperature_c=d.temperature_c,
                power_w=d.power_w,
            )
            for entry in self.entries.values():
                for event in entry.engine.observe(uuid, observed):
                    events.append(event_json(event))
        self.recent.extend(events)
        return events

    def active(self) -> list[dict[str, Any]]:
        if self.alerts is None:
            return []
        return [event_json(a) for e in self.entries.values() for a in e.engine.active()]
