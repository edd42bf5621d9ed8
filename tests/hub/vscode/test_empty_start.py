"""A start through the API with an empty body (VS Code's) picks its profile on purpose: the
named-server convention or the user's default profile, never the last start's options."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from traitlets.config import Config

from tests.harness.hub import Hub
from tests.harness.vscode import make_ide_token


@pytest.fixture(scope="module")
def hub(make_module_hub) -> Iterator[Hub]:
    hub = make_module_hub(Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"}))
    hub.create_user("alice")
    yield hub


def _empty_start(hub: Hub, server: str = "") -> dict:
    path = f"/users/alice/servers/{server}" if server else "/users/alice/server"
    r = hub.api("POST", path)  # no body at all, as VS Code's startServer
    assert r.status_code in (201, 202), f"{r.text}\n{hub.log()[-3000:]}"
    return hub.wait_ready("alice", server)


def test_empty_start_after_a_gpu_start_gets_the_default_profile_not_the_last_one(hub):
    hub.start_server("alice", profile="gpu-quarter")
    assert hub.server_env("alice")["GPULAB_PROFILE"] == "gpu-quarter"
    hub.stop_server("alice")

    model = _empty_start(hub)

    assert model["user_options"]["profile"] == "cpu"
    assert hub.server_env("alice")["GPULAB_PROFILE"] == "cpu"
    assert [a["gpus"] for a in hub.allocations().values()] == [[]]  # no GPU share taken
    assert "Start of alice/ without options: profile 'cpu' (the default profile)" in hub.log()
    hub.stop_server("alice")


def test_empty_start_of_a_named_server_called_like_a_profile_gets_that_profile(hub):
    model = _empty_start(hub, "gpu-quarter")

    assert model["user_options"]["profile"] == "gpu-quarter"
    (alloc,) = hub.allocations().values()
    assert [g["milli"] for g in alloc["gpus"]] == [250]
    env = hub.server_env("alice", "gpu-quarter")
    assert env["CUDA_VISIBLE_DEVICES"] == alloc["gpus"][0]["uuid"]
    assert "profile 'gpu-quarter' (the server's name)" in hub.log()
    hub.stop_server("alice", "gpu-quarter")


def test_empty_start_of_another_named_server_gets_the_default_profile(hub):
    model = _empty_start(hub, "scratch")

    assert model["user_options"]["profile"] == "cpu"
    assert hub.server_env("alice", "scratch")["GPULAB_PROFILE"] == "cpu"
    hub.stop_server("alice", "scratch")


def test_a_start_naming_a_profile_still_gets_it(hub):
    r = hub.spawn("alice", "scratch2", profile="gpu-half")
    assert r.status_code in (201, 202), r.text

    assert hub.wait_ready("alice", "scratch2")["user_options"]["profile"] == "gpu-half"
    hub.stop_server("alice", "scratch2")


def test_capacity_says_which_profile_an_empty_start_gets_and_the_ide_token_reads_it(hub):
    token = make_ide_token(hub, "alice")
    r = hub.client.get("/gpulab/capacity", headers={"Authorization": f"token {token}"})

    assert r.status_code == 200, r.text
    body = r.json()
    assert body["default_profile"] == "cpu"
    assert "named server called like one of these profiles" in body["empty_start"]
    assert "gpu-quarter" in {p["slug"] for p in body["profiles"]}
