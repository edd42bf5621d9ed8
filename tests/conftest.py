from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.hubtools import Hub

# Hypothesis' per-example deadline is a timing assertion: on a loaded 2-core machine it fails tests
# whose logic is fine. Properties are about correctness only here.
settings.register_profile("gpulab", deadline=None)
settings.load_profile("gpulab")


@pytest.hookimpl(trylast=True)  # after tests/kube/conftest.py has marked its tests `kube`
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # With pytest-xdist (`bash .ci/dev test` runs two workers), every test that needs the dev
    # cluster runs on one worker: one control plane at a time, and the clusters' pod addresses
    # and node processes never meet another worker's.
    for item in items:
        if item.get_closest_marker("kube"):
            item.add_marker(pytest.mark.xdist_group("dev-cluster"))


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
    for hub in hubs:
        hub.cleanup()
