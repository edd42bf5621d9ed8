"""End to end: a real JupyterHub + proxy spawning real single-user servers with GPU profiles."""

from __future__ import annotations

import os
import re
import signal
import time

from traitlets.config import Config

from tests.harness.hub import merged, run_in_kernel

TWO_A100 = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})


async def test_fractional_profile_gets_its_gpu_by_uuid_and_capacity_drops(make_hub):
    hub = make_hub(TWO_A100)
    hub.create_user("alice")
    before = hub.capacity()
    assert before["gpu-quarter"]["free"] == 8
    assert before["gpu-quarter"]["label"] == "1/4 GPU - 8 free"

    hub.start_server("alice", profile="gpu-quarter")

    after = hub.capacity()
    assert after["gpu-quarter"]["free"] == 7
    assert after["gpu-1"]["free"] == 1
    (alloc,) = hub.allocations().values()
    assert alloc["owner"] == "alice"
    assert [g["milli"] for g in alloc["gpus"]] == [250]
    uuid = alloc["gpus"][0]["uuid"]

    env = hub.server_env("alice")
    assert env["CUDA_VISIBLE_DEVICES"] == uuid
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert env["GPULAB_GPU_ENFORCEMENT"] == "framework-caps"
    assert env["GPULAB_GPU_MEMORY_LIMIT_MIB"] == str(81920 // 4)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"
    # the kernel a user runs sees the same share
    out = await run_in_kernel(
        hub,
        "alice",
        "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPULAB_PROFILE'])",
    )
    assert out.split() == [uuid, "gpu-quarter"]


def test_whole_gpus_are_exclusive_and_cpu_only_hides_gpus(make_hub):
    hub = make_hub(TWO_A100)
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="gpu-1")
    hub.start_server("bob", profile="gpu-1")
    allocs = hub.allocations()
    uuids = {a["gpus"][0]["uuid"] for a in allocs.values()}
    assert len(uuids) == 2, allocs  # one GPU each, never the same one twice
    assert hub.server_env("alice")["CUDA_VISIBLE_DEVICES"] in uuids
    assert hub.server_env("alice")["GPULAB_GPU_ENFORCEMENT"] == "exclusive"
    assert hub.capacity()["gpu-1"]["label"] == "1 GPU - none free"

    hub.create_user("carol")
    hub.start_server("carol", profile="cpu")
    env = hub.server_env("carol")
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_profile_larger_than_the_machine_is_refused_with_the_reason(make_hub):
    hub = make_hub(TWO_A100)
    hub.create_user("alice")
    r = hub.spawn("alice", profile="gpu-8")
    assert r.status_code == 409, r.text
    assert r.json()["message"].startswith(
        "Profile '8 GPUs' asks for more than any machine here has"
    )
    assert hub.allocations() == {}


def test_request_that_does_not_fit_is_refused_with_409_and_nothing_leaks(make_hub):
    hub = make_hub(Config(GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"}))
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="gpu-half")
    r = hub.spawn("bob", profile="gpu-1")
    assert r.status_code == 409, r.text
    message = r.json()["message"]
    assert "'1 GPU' cannot start now" in message
    assert hub.server_model("bob") is None
    assert set(hub.allocations()) == {"alice/"}
    # the half that is left still fits
    hub.start_server("bob", profile="gpu-half")
    assert hub.capacity()["gpu-eighth"]["free"] == 0


def test_named_servers_each_hold_their_own_share(make_hub):
    hub = make_hub(TWO_A100)
    hub.create_user("alice")
    hub.start_server("alice", "train", profile="gpu-half")
    hub.start_server("alice", "explore", profile="gpu-eighth")
    allocs = hub.allocations()
    assert {a: [g["milli"] for g in v["gpus"]] for a, v in allocs.items()} == {
        "alice/train": [500],
        "alice/explore": [125],
    }
    assert hub.server_env("alice", "explore")["GPULAB_GPU_MEMORY_LIMIT_MIB"] == str(81920 // 8)
    hub.stop_server("alice", "train")
    assert set(hub.allocations()) == {"alice/explore"}


def test_stopping_a_server_frees_its_share(make_hub):
    hub = make_hub(merged(TWO_A100, Config(GPUCapacity={"user_quota_gpus": {"alice": 2}})))
    hub.create_user("alice")
    hub.start_server("alice", profile="gpu-2")
    assert hub.capacity()["gpu-1"]["free"] == 0
    hub.stop_server("alice")
    assert hub.allocations() == {}
    assert hub.capacity()["gpu-2"]["free"] == 1
    assert hub.capacity()["gpu-quarter"]["free"] == 8


def test_crashed_server_frees_its_share(make_hub):
    hub = make_hub(TWO_A100)
    hub.create_user("alice")
    hub.start_server("alice", profile="gpu-1")
    os.kill(hub.server_pid("alice"), signal.SIGKILL)
    # the share goes first, then (after the on-exit snapshot) the hub forgets the server
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (hub.allocations() or hub.server_model("alice")):
        time.sleep(0.3)
    assert hub.allocations() == {}
    assert hub.server_model("alice") is None
    assert hub.capacity()["gpu-2"]["free"] == 1


def test_picker_shows_live_capacity_and_declared_inventory(make_hub):
    hub = make_hub(TWO_A100)
    hub.create_user("alice")
    hub.start_server("alice", "one", profile="gpu-1")
    admin = hub.login("admin", hub.admin_password())
    r = admin.get("/hub/spawn/alice/two")
    assert r.status_code == 200, r.text
    page = r.text
    assert "declared: 2 x A100-SXM4-80GB" in page
    assert 'name="profile" id="profile-gpu-quarter"' in page
    assert "(1/4 GPU - 4 free)" in page
    assert "(2 GPUs - none free)" in page
    assert "(8 GPUs - larger than any machine here)" in page
    assert 'id="profile-gpu-8" value="gpu-8"\n           \n           disabled' in page
    assert "Exclusive: these 2 GPUs are yours alone" in page
    assert "cooperative caps" in page


def test_idle_culler_stops_an_idle_server_and_frees_its_share(make_hub):
    hub = make_hub(TWO_A100, env={"GPULAB_CULL_IDLE_SECONDS": "4"})
    hub.create_user("alice")
    hub.start_server("alice", profile="gpu-half")
    assert "alice/" in hub.allocations()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and hub.server_model("alice") is not None:
        time.sleep(0.5)
    assert hub.server_model("alice") is None
    assert hub.allocations() == {}
    assert "Culling server alice (inactive for" in hub.log()


def test_profile_cpu_and_memory_limits_reach_the_server(make_hub):
    small = {"slug": "small", "gpus": "1/8", "cpu_limit": 1, "mem_limit": "2G"}
    hub = make_hub(merged(TWO_A100, Config(GPUCapacity={"profiles": [small]})))
    hub.create_user("alice")
    hub.start_server("alice", profile="small")
    env = hub.server_env("alice")
    assert env["MEM_LIMIT"] == str(2 * 1024**3)
    assert env["CPU_LIMIT"] == "1.0"


def test_the_shipped_quota_is_one_gpu_per_user_and_the_picker_closes_what_would_exceed_it(
    make_hub,
):
    hub = make_hub(TWO_A100)
    hub.create_user("alice")
    hub.create_user("bob")
    r = hub.spawn("alice", profile="gpu-2")
    assert r.status_code == 403, r.text
    assert r.json()["message"] == (
        "GPU quota exceeded: User 'alice' asks for 2 GPUs but has 1 GPU of a 1 GPU budget left. "
        "Stop one of your GPU servers, or pick a profile within the 1 GPU left "
        "('gpu-1', 'gpu-half', 'gpu-quarter', 'gpu-eighth')."
    )
    assert hub.allocations() == {}
    hub.start_server("alice", "a", profile="gpu-half")

    admin = hub.login("admin", hub.admin_password())
    page = admin.get("/hub/spawn/alice/b").text
    assert "GPU quota: 0.5 GPU in use, 0.5 GPU left" in page
    closed = dict(
        re.findall(
            r'id="profile-([a-z0-9-]+)" value="[^"]+"\s*(?:checked)?\s*disabled>.*?'
            r'gpulab-closed-reason text-danger">([^<]+)<',
            page,
            flags=re.S,
        )
    )
    assert closed == {
        "gpu-1": "Needs 1 GPU; your GPU quota has 0.5 GPU left",
        "gpu-2": "Needs 2 GPUs; your GPU quota has 0.5 GPU left",
        "gpu-4": "Larger than any machine here",
        "gpu-8": "Larger than any machine here",
    }
    # what the picker leaves open starts; another user's budget is their own
    hub.start_server("alice", "b", profile="gpu-half")
    hub.start_server("bob", profile="gpu-1")
    assert {a: v["owner"] for a, v in hub.allocations().items()} == {
        "alice/a": "alice",
        "alice/b": "alice",
        "bob/": "bob",
    }
