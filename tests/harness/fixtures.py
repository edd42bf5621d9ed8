"""pytest fixtures of the harness, loaded as a plugin for every test folder (`-p tests.harness.fixtures`
in pyproject.toml), the extension's own tests included."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.harness.hub import Hub

# Hypothesis' per-example deadline is a timing assertion: on a loaded 2-core machine it fails tests
# whose logic is fine. Properties are about correctness only here.
settings.register_profile("gpulab", deadline=None)
settings.load_profile("gpulab")


# The dev-cluster tests (marked `kube`) never share a run with pytest-xdist workers: `bash .ci/dev
# test` runs them after the rest, in a pytest of their own, since two clusters at once would share
# pod addresses and the node agents' nftables table. (An xdist_group set here was never seen:
# pytest-xdist reads groups before conftest hooks add them.)


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
