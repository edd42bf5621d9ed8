"""VS Code's JupyterHub extension, replayed request by request against a real hub: connect with an
IDE token typed as the password, start a named server called like a GPU profile with an empty
body, run a cell over the kernel websocket with the token in the URL only, stop. 20/20 rounds.

The sequence and its upstream source (microsoft/vscode-jupyter-hub, src/jupyterHubApi.ts,
src/validator.ts, src/jupyterIntegration.ts) are described in `tests.harness.vscode`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from traitlets.config import Config

from tests.harness.hub import Hub
from tests.harness.vscode import make_ide_token, replay, stop_server

ROUNDS = 20
#: a fractional GPU profile of the default catalog, picked by naming the server like it
SERVER = "gpu-quarter"
#: the replay's steps before it starts anything
BEFORE_START = ("connect", "verify token", "list servers", "validate")


@pytest.fixture(scope="module")
def hub(make_module_hub) -> Iterator[Hub]:
    hub = make_module_hub(Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"}))
    hub.create_user("alice")
    yield hub


async def _round(hub: Hub, token: str, token_in: str) -> str:
    """One replay; '' when it ran a cell on its GPU share, else what went wrong."""
    result = await replay(hub.url, "alice", token, SERVER, token_in=token_in, stop=False)
    try:
        if not result.ok:
            return f"{result.failed_step}: {result.error}"
        if result.user_options.get("profile") != SERVER:
            return f"started with {result.user_options}"
        (alloc,) = hub.allocations().values()
        uuid = alloc["gpus"][0]["uuid"]
        if result.env != {
            "CUDA_VISIBLE_DEVICES": uuid,
            "NVIDIA_VISIBLE_DEVICES": uuid,
            "GPULAB_PROFILE": SERVER,
        }:
            return f"kernel environment {result.env}, share {uuid}"
        return ""
    finally:
        if result.ok or result.failed_step not in BEFORE_START:
            # the server may run: stop it with the same token, as its user would
            await stop_server(hub.url, "alice", token, SERVER)


async def test_vscode_sequence_runs_a_gpu_cell_20_times_out_of_20(hub):
    token = make_ide_token(hub, "alice")

    failures = [await _round(hub, token, "url") for _ in range(ROUNDS)]

    ok = failures.count("")
    assert ok == ROUNDS, f"vscode_ok={ok}/{ROUNDS}: {[f for f in failures if f]}"
    assert hub.allocations() == {}  # every round gave its share back


async def test_vscode_sequence_with_the_token_in_the_websocket_header(hub):
    token = make_ide_token(hub, "alice")

    assert await _round(hub, token, "header") == ""
