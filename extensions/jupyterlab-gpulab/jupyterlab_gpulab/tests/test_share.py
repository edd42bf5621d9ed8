"""The share a server reads from its environment, as each spawner writes it."""

from __future__ import annotations

from jupyterlab_gpulab.share import share_from_env


def test_on_kubernetes_the_device_plugins_devices_are_the_shares_devices() -> None:
    env = {
        "NVIDIA_VISIBLE_DEVICES": "MIG-gk-a100-mig-0-2g.20gb-1",
        "GPULAB_GPU_FRACTION": "0.250",
        "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
        "GPULAB_GPU_ENFORCEMENT": "mig",
    }
    share = share_from_env(env)
    assert share.uuids == ("MIG-gk-a100-mig-0-2g.20gb-1",)
    assert share.fraction == 0.25 and share.memory_limit_mib == 20480
    assert share.enforcement == "mig"


def test_the_spawners_list_wins_and_void_or_all_name_no_device() -> None:
    both = {"GPULAB_GPU_UUIDS": "GPU-a", "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    assert share_from_env(both).uuids == ("GPU-a",)
    for value in ("void", "none", "all", ""):
        share = share_from_env({"NVIDIA_VISIBLE_DEVICES": value})
        assert share.uuids == () and share.enforcement == "none"
