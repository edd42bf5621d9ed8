from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.hubtools import Hub


@pytest.fixture
def make_hub(tmp_path: Path) -> Iterator[Callable[..., Hub]]:
    """Start real hubs with a config overlay; every hub and server is stopped at teardown."""
    hubs: list[Hub] = []

    def make(
        overlay: str = "",
        *,
        start: bool = True,
        name: str = "hub",
        env: dict[str, str] | None = None,
    ) -> Hub:
        hub = Hub(tmp_path / name, overlay, env)
        hubs.append(hub)
        if start:
            hub.start()
        return hub

    yield make
    for hub in hubs:
        hub.close()
