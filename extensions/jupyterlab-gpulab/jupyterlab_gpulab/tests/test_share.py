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


def test_a_cpu_only_server_shows_no_gpu_whatever_the_source() -> None:
    from jupyterlab_gpulab.sources import CPU_ONLY_MESSAGE, SimulatedSource, select_source

    share = share_from_env({"GPULAB_GPU_ENFORCEMENT": "cpu-only", "NVIDIA_VISIBLE_DEVICES": "void"})
    for mode in ("auto", "nvml", "simulated", "none"):
        source = select_source(mode, share)
        assert source.devices() == [] and source.sample() == {}
        assert source.message == CPU_ONLY_MESSAGE
    assert SimulatedSource(share).devices() == []  # even when built directly


def test_the_simulated_source_takes_the_shape_of_the_placed_gpu(monkeypatch) -> None:
    from jupyterlab_gpulab import sources

    def no_driver(share):
        raise OSError("no NVIDIA driver (test)")

    monkeypatch.setattr(sources, "NvmlSource", no_driver)
    mig = share_from_env(
        {
            "NVIDIA_VISIBLE_DEVICES": "MIG-gk-a100-mig-0-2g.20gb-0",
            "GPULAB_GPU_MODEL": "A100-SXM4-80GB MIG 2g.20gb",
            "GPULAB_GPU_DEVICE_MEMORY_MIB": "20480",
            "GPULAB_GPU_FRACTION": "0.250",
            "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
            "GPULAB_GPU_ENFORCEMENT": "mig",
            "GPULAB_GPU_INVENTORY": "simulated",
        }
    )
    source = sources.select_source("auto", mig)
    assert source.simulated and "Simulated" in source.message
    (device,) = source.devices()
    assert device.name == "Simulated NVIDIA A100-SXM4-80GB MIG 2g.20gb" and device.mig
    assert device.memory_total_mib == 20480 and device.memory_limit_mib == 20480
    whole = share_from_env(
        {
            "GPULAB_GPU_UUIDS": "GPU-1,GPU-2",
            "GPULAB_GPU_MODEL": "A100-SXM4-80GB",
            "GPULAB_GPU_DEVICE_MEMORY_MIB": "81920",
            "GPULAB_GPU_INVENTORY": "declared",
        }
    )
    names = {d.name for d in sources.select_source("auto", whole).devices()}
    assert names == {"Simulated NVIDIA A100-SXM4-80GB"}
    # a measured inventory's server without NVML shows nothing rather than invented figures
    measured = share_from_env({"GPULAB_GPU_UUIDS": "GPU-1", "GPULAB_GPU_MODEL": "A100-SXM4-80GB"})
    assert sources.select_source("auto", measured).devices() == []
