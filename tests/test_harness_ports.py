"""The test harness's own ports: every block it hands out lies below the kernel's ephemeral range."""

from __future__ import annotations

import pytest

from tests.harness import ports


def test_no_worker_block_reaches_the_kernels_ephemeral_range() -> None:
    # a port in the ephemeral range can be handed to an outgoing connection after free_port()
    # checked it and before the test's server binds it
    low, _ = ports.ephemeral_range()
    assert low >= ports.PORTS_END, (ports.PORTS_END, low)


def test_free_port_outside_xdist_comes_from_the_last_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    port = ports.free_port()
    assert ports.PORTS_END - ports._BLOCK <= port < ports.PORTS_END
