"""The benchmarks' last line: `name=value ...`, every value a number or `n/a`, and the line
before it saying why each `n/a` is one (a reader of the last line alone sees what was not
measured; the line before tells her why)."""

from __future__ import annotations

from collections.abc import Mapping

NA = "n/a"


def last_lines(fields: Mapping[str, str | None], why_not: Mapping[str, str]) -> list[str]:
    """The contract's closing lines: the reasons for the fields that are None (one line,
    only when there is one), then `name=value ...` with `n/a` for them. A None field without a
    reason in `why_not` is a mistake of the benchmark's: it raises ValueError."""
    missing = [name for name, value in fields.items() if value is None]
    unexplained = [name for name in missing if not why_not.get(name)]
    if unexplained:
        raise ValueError(f"n/a without a reason: {', '.join(unexplained)}")
    last = " ".join(f"{name}={NA if value is None else value}" for name, value in fields.items())
    if not missing:
        return [last]
    return ["n/a: " + "; ".join(f"{name}: {why_not[name]}" for name in missing), last]


def print_last_lines(fields: Mapping[str, str | None], why_not: Mapping[str, str]) -> None:
    for line in last_lines(fields, why_not):
        print(line, flush=True)
