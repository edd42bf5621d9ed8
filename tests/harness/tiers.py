"""What a test started, for the tier rule's safety net (tests/harness/fixtures.py).

The harness classes note here each real thing they start (a hub, a lab server, a dev cluster, a
browser) under the marker of its tier; after a test's setup and call, the plugin takes the notes
and fails a test that started something its markers do not say, i.e. one that went around the
fixtures. Outside pytest (the benchmarks) nobody takes the notes and they cost nothing.
"""

from __future__ import annotations

_started: set[str] = set()


def note_started(marker: str) -> None:
    """Record that a real thing of tier `marker` (e2e, browser, kube) was just started."""
    _started.add(marker)


def take_started() -> set[str]:
    """The markers noted since the last call, forgetting them."""
    out = set(_started)
    _started.clear()
    return out
