"""Kubernetes quantities and timestamps as numbers (pure): CPU, memory, counts, bytes, RFC 3339."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any


def quantity_int(value: Any) -> int:
    """A count quantity ('8', '2k'), as Nodes advertise extended resources."""
    text = str(value)
    if text.endswith("k"):
        return int(text[:-1]) * 1000
    return int(text)


def cpu_milli(value: Any) -> int:
    """A CPU quantity ('500m', '16', '0.5') in millicores."""
    text = str(value)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


_MEM_SUFFIX = {
    "Ki": 1 / 1024,
    "Mi": 1,
    "Gi": 1024,
    "Ti": 1024**2,
    "K": 1000 / 1024**2,
    "M": 1000**2 / 1024**2,
    "G": 1000**3 / 1024**2,
}


def memory_mib(value: Any) -> int:
    """A memory quantity ('64Gi', '1000M', bytes) in MiB, rounded down."""
    text = str(value)
    for suffix, factor in sorted(_MEM_SUFFIX.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(int(text) / 1024**2)


_QUANTITY_FACTORS = {
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "E": 1000**6,
}


def quantity_bytes(value: Any) -> int | None:
    """A Kubernetes quantity ('1Gi', '12345', 5e3) in bytes; None when absent or malformed."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    for suffix in sorted(_QUANTITY_FACTORS, key=len, reverse=True):
        if text.endswith(suffix):
            number, factor = text[: -len(suffix)], _QUANTITY_FACTORS[suffix]
            break
    else:
        number, factor = text, 1
    try:
        return int(float(number) * factor)
    except ValueError:
        return None


def parse_time(value: Any) -> float | None:
    """RFC 3339 ('2026-12-02T18:05:12Z', fractions and offsets too) -> epoch seconds."""
    if not value:
        return None
    text = str(value).replace("Z", "+00:00")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()
