"""End to end: a real JupyterHub + proxy spawning real single-user servers with GPU profiles."""

from __future__ import annotations

import pytest

from tests.hubtools import run_in_kernel

pytestmark = pytest.mark.e2e

TWO_A100 = "c.GPUCapacity.declared_inventory = '2 x A100-SXM4-80GB'\n"


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
