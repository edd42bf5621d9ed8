"""The rule tree (frozen dataclasses), the metric and unit tables, and the canonical text form."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# metric -> the units a threshold on it may have ('%' is of the share: utilisation 0-100 %,
# memory as a percentage of the share's memory limit)
MEMORY_UNITS = ("%", "MiB", "GiB", "TiB", "MB", "GB", "TB")
METRICS: dict[str, tuple[str, ...]] = {
    "gpu_utilization": ("%",),
    "gpu_memory_used": MEMORY_UNITS,
    "gpu_memory_free": MEMORY_UNITS,
    "gpu_temperature": ("C",),
    "gpu_power": ("W",),
}
# unit -> factor to the metric's base unit (MiB for memory, % / degC / W otherwise)
MIB = 1024.0 * 1024.0
UNIT_FACTORS: dict[str, float] = {
    "%": 1.0,
    "MiB": 1.0,
    "GiB": 1024.0,
    "TiB": 1024.0 * 1024.0,
    "MB": 1e6 / MIB,
    "GB": 1e9 / MIB,
    "TB": 1e12 / MIB,
    "C": 1.0,
    "W": 1.0,
}
# spellings accepted in rules (case-insensitive) -> canonical unit
UNIT_SPELLINGS: dict[str, str] = {u.lower(): u for u in UNIT_FACTORS}
UNIT_SPELLINGS["°c"] = "C"
Comparator = Literal[">", ">=", "<", "<=", "==", "!="]
COMPARATORS: tuple[Comparator, ...] = (">", ">=", "<", "<=", "==", "!=")
SEVERITIES = ("warning", "critical")
DEFAULT_SEVERITY = "warning"


@dataclass(frozen=True)
class Condition:
    """`metric op value unit [FOR duration]`; for_seconds 0 means no FOR (true at once)."""

    metric: str
    op: Comparator
    value: float
    unit: str
    for_seconds: int = 0

    def to_text(self) -> str:
        text = f"{self.metric} {self.op} {format_number(self.value)}{self.unit}"
        if self.for_seconds:
            text += f" FOR {format_duration(self.for_seconds)}"
        return text

    @property
    def base_value(self) -> float:
        """The threshold in the metric's base unit (MiB for absolute memory)."""
        return self.value * UNIT_FACTORS[self.unit]


@dataclass(frozen=True)
class Not:
    operand: Expr

    def to_text(self) -> str:
        inner = self.operand.to_text()
        return f"NOT {inner}" if isinstance(self.operand, (Condition, Not)) else f"NOT ({inner})"


@dataclass(frozen=True)
class And:
    operands: tuple[Expr, ...]

    def to_text(self) -> str:
        return " AND ".join(_operand_text(o) for o in self.operands)


@dataclass(frozen=True)
class Or:
    operands: tuple[Expr, ...]

    def to_text(self) -> str:
        return " OR ".join(_operand_text(o) for o in self.operands)


Expr = Condition | Not | And | Or


def _operand_text(expr: Expr) -> str:
    # nested AND/OR keep their parentheses, so the tree survives a round trip unchanged
    text = expr.to_text()
    return f"({text})" if isinstance(expr, (And, Or)) else text


@dataclass(frozen=True)
class Action:
    """`alert("NAME", severity="warning", message="...")`."""

    name: str
    severity: str = DEFAULT_SEVERITY
    message: str | None = None

    def to_text(self) -> str:
        args = [quote(self.name), f"severity={quote(self.severity)}"]
        if self.message is not None:
            args.append(f"message={quote(self.message)}")
        return f"alert({', '.join(args)})"


@dataclass(frozen=True)
class Rule:
    condition: Expr
    action: Action

    @property
    def name(self) -> str:
        return self.action.name

    @property
    def severity(self) -> str:
        return self.action.severity

    @property
    def message(self) -> str:
        """The action's message, or a description of the condition when it has none."""
        if self.action.message is not None:
            return self.action.message
        return f"{self.name}: {self.condition.to_text()}"

    def to_text(self) -> str:
        """Canonical text: parse_rule(rule.to_text()) == rule."""
        return f"IF {self.condition.to_text()} THEN {self.action.to_text()}"

    def conditions(self) -> list[Condition]:
        """Every condition, left to right."""
        return list(iter_conditions(self.condition))


def iter_conditions(expr: Expr) -> list[Condition]:
    out: list[Condition] = []
    stack: list[Expr] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, Condition):
            out.append(node)
        elif isinstance(node, Not):
            stack.append(node.operand)
        else:
            stack.extend(reversed(node.operands))
    return out


def format_number(value: float) -> str:
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


_DURATION_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def format_duration(seconds: int) -> str:
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in _DURATION_UNITS:
        n, seconds = divmod(seconds, size)
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts)


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def quote(text: str) -> str:
    return '"' + "".join(_ESCAPES.get(ch, ch) for ch in text) + '"'
