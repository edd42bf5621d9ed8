"""What a user's server reports for culling, and how the hub reads it (no I/O).

A server's lab extension (jupyterlab_gpulab/culling.py) POSTs, with the server's own
$JUPYTERHUB_API_TOKEN::

    {"input_seconds_ago": {"ui-input": 12.5, "kernel-execute": 40, "terminal-input": null},
     "busy_kernels": 1, "kernels": 2, "keep_alive": false}

Ages, not timestamps: the server's clock need not agree with the hub's. A user's server is
untrusted code, so a report is believed only about that server (the route names it and the token
must hold `users:activity` on its owner, see gpulab.hub.apihandlers.culling), and the worst a lying
report can do is keep its own server from being culled, which the user could do anyway with a busy
loop in a kernel. It can never make a server culled sooner: input and busy kernels only ever
exempt, and a report of "no input" is what the hub assumes without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from gpulab.hub.culling import USER_INPUT_KINDS, Activity, ActivityKind, last_user_input

#: a report claims at most this many kernels (a server with more is a typo or a lie; capped, not refused)
MAX_KERNELS = 10_000
#: how long ago an input may lie (older ones are as good as none)
MAX_AGE_SECONDS = 366 * 86400


class ReportRefused(ValueError):
    """A report the hub cannot read; ``field`` names the key to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ServerReport:
    """One server's latest report, on the hub's clock. ``last_user_input_at`` is real input only
    (gpulab.hub.culling.USER_INPUT_KINDS); None: none since the extension started."""

    received_at: float
    last_user_input_at: float | None
    busy_kernels: int
    kernels: int


def parse_report(body: Any, now: float) -> tuple[ServerReport, bool]:
    """The report in ``body`` received at ``now``, and whether it asks to keep the server alive.

    Input kinds other than USER_INPUT_KINDS are ignored (a newer extension may report more), so
    nothing but a person's keys, clicks, cells and terminal input ever counts as input."""
    if not isinstance(body, Mapping):
        raise ReportRefused("body", "expected a JSON object")
    known = {"input_seconds_ago", "busy_kernels", "kernels", "keep_alive"}
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        raise ReportRefused(unknown[0][:40], f"no such field; known: {', '.join(sorted(known))}")
    ages = body.get("input_seconds_ago") or {}
    if not isinstance(ages, Mapping):
        raise ReportRefused("input_seconds_ago", "expected an object of input kind to seconds")
    activities = []
    for kind, age in ages.items():
        if age is None or kind not in USER_INPUT_KINDS:
            continue
        where = f"input_seconds_ago.{kind}"
        if isinstance(age, bool) or not isinstance(age, int | float) or age != age:
            raise ReportRefused(where, f"expected seconds, got {str(age)[:40]!r}")
        # a negative age (input "in the future") is input now, no more
        activities.append(
            Activity(cast(ActivityKind, kind), now - min(max(0.0, age), MAX_AGE_SECONDS))
        )
    counts = []
    for name in ("busy_kernels", "kernels"):
        value = body.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ReportRefused(name, f"expected a count (0 or more), got {str(value)[:40]!r}")
        counts.append(min(value, MAX_KERNELS))
    keep_alive = body.get("keep_alive", False)
    if not isinstance(keep_alive, bool):
        raise ReportRefused("keep_alive", f"expected true or false, got {str(keep_alive)[:40]!r}")
    report = ServerReport(now, last_user_input(activities), counts[0], counts[1])
    return report, keep_alive
