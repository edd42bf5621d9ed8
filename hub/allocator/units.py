"""Formatting exact milli-GPU amounts for messages."""

from __future__ import annotations

from .model import MILLI


def fmt_gpus(milli: int) -> str:
    """``1500 -> '1.5 GPUs'``, ``125 -> '0.125 GPU'``, exact (no float rounding)."""
    whole, frac = divmod(milli, MILLI)
    text = str(whole) if not frac else f"{whole}.{frac:03d}".rstrip("0")
    return f"{text} GPU" if milli <= MILLI else f"{text} GPUs"
