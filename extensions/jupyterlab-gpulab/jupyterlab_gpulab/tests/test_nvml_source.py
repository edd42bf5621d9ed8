"""The monitor's NVML source over the labelled FAKE pynvml (tests/harness/fake_nvml): the same
code that reads a real driver, run in CI where there is none."""

from __future__ import annotations

import os

from jupyterlab_gpulab.share import share_from_env
from jupyterlab_gpulab.sources import NvmlSource
from tests.harness.fake_nvml import a100, installed, mig_instance

ME = os.getpid()
OTHER = 1  # init: never this server's


def _machine() -> dict:
    return {
        "gpus": [
            a100(
                0,
                utilization=90,
                memory_used_mib=50000,
                temperature=61,
                power_mw=310_000,
                processes=[
                    {"pid": ME, "memory_mib": 4000, "sm_util": 35},
                    {"pid": OTHER, "memory_mib": 46000, "sm_util": 55},
                ],
            ),
            a100(
                1,
                mig={
                    "max": 7,
                    "instances": [
                        mig_instance(
                            1,
                            3,
                            "2g.20gb",
                            19968,
                            memory_used_mib=7000,
                            processes=[{"pid": ME, "memory_mib": 7000}],
                        )
                    ],
                },
            ),
        ]
    }


def test_a_mig_share_sees_its_instance_only_with_the_instances_own_figures():
    uuid = mig_instance(1, 3, "2g.20gb", 0)["uuid"]
    share = share_from_env(
        {
            "GPULAB_GPU_UUIDS": uuid,
            "GPULAB_GPU_FRACTION": "0.250",
            "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
        }
    )
    with installed(_machine()):
        source = NvmlSource(share, env={})
        (device,) = source.devices()
        assert device.uuid == uuid and device.mig and not device.whole
        assert device.name == "NVIDIA A100-SXM4-80GB MIG 2g.20gb"
        assert device.memory_total_mib == 19968 and device.memory_limit_mib == 19968
        sample = source.sample()[uuid]
        source.close()
    assert sample.utilization_pct is None  # NVML has no utilisation for a MIG instance
    assert sample.memory_used_mib == 7000 and sample.memory_scope == "device"
    assert sample.temperature_c is None and sample.power_w is None  # the parent's sensors


def test_a_fraction_of_a_shared_gpu_counts_only_its_own_processes():
    uuid = a100(0)["uuid"]
    share = share_from_env(
        {
            "GPULAB_GPU_UUIDS": uuid,
            "GPULAB_GPU_FRACTION": "0.250",
            "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
        }
    )
    with installed(_machine()) as fake:
        source = NvmlSource(share, env={})
        first = source.sample()[uuid]
        again = source.sample()[uuid]  # no process ran since: NVML's NotFound means 0 %
        source.close()
        assert fake.CALLS["nvmlInit"] == 1
    assert first.memory_used_mib == 4000 and first.memory_scope == "own_processes"
    assert first.utilization_pct == 35 and first.utilization_scope == "own_processes"
    assert again.utilization_pct == 0.0
    assert first.temperature_c is None  # neighbours share the sensors
    assert {p.pid: p.own for p in first.processes} == {ME: True, OTHER: False}


def test_a_whole_gpu_has_the_devices_figures_and_sensors_and_no_mig_parent_is_listed():
    share = share_from_env({"GPULAB_GPU_UUIDS": a100(0)["uuid"]})
    with installed(_machine()):
        source = NvmlSource(share, env={})
        (device,) = source.devices()
        sample = source.sample()[device.uuid]
        source.close()
    assert device.whole and sample.utilization_pct == 90 and sample.memory_used_mib == 50000
    assert sample.temperature_c == 61 and sample.power_w == 310
    # a server not started by gpulab lists the GPUs NVML counts (instances only when named)
    with installed(_machine()):
        unmanaged = NvmlSource(share_from_env({}), env={})
        names = [d.uuid for d in unmanaged.devices()]
        unmanaged.close()
    assert names == [a100(0)["uuid"], a100(1)["uuid"]]


def test_whole_gpus_read_their_process_list_every_few_seconds_fractions_every_sample():
    whole = share_from_env({"GPULAB_GPU_UUIDS": a100(0)["uuid"]})
    fraction = share_from_env({"GPULAB_GPU_UUIDS": a100(0)["uuid"], "GPULAB_GPU_FRACTION": "0.250"})
    reads = {}
    for name, share in (("whole", whole), ("fraction", fraction)):
        with installed(_machine()):
            source = NvmlSource(share, env={}, process_list_seconds=60)
            samples = [source.sample() for _ in range(3)]
            source.close()
        reads[name] = source.call_counts().get("nvmlDeviceGetComputeRunningProcesses", 0)
        # the list read first is kept: the processes stay named between reads
        assert [len(s[share.uuids[0]].processes) for s in samples] == [2, 2, 2]
    assert reads == {"whole": 1, "fraction": 3}
    with installed(_machine()):  # 0: every sample, as before
        source = NvmlSource(whole, env={}, process_list_seconds=0)
        for _ in range(3):
            source.sample()
        source.close()
    assert source.call_counts()["nvmlDeviceGetComputeRunningProcesses"] == 3


def test_a_real_server_reads_its_mig_instance_from_the_fake_driver_in_a_subprocess(
    make_lab_server, tmp_path
):
    """The fake works across processes: a real `jupyter server` whose `import pynvml` is the fake
    lists and samples its MIG instance through the NVML source, as on a machine with a driver."""
    from tests.harness.fake_nvml import subprocess_env
    from tests.harness.labserver import EXTENSION_SRC, REPO
    from tests.harness.wait import wait_for

    mig = mig_instance(1, 3, "2g.20gb", 19968)["uuid"]
    env = subprocess_env(
        _machine(), tmp_path / "machine.json", pythonpath=f"{EXTENSION_SRC}:{REPO}"
    )
    lab = make_lab_server(
        env={**env, "GPULAB_MONITOR_SOURCE": "nvml", "GPULAB_GPU_UUIDS": mig},
        config='c.GPUMonitor.source = "nvml"\nc.GPUMonitor.period_seconds = 0.25\n',
        extensions={"jupyterlab_gpulab": True, "jupyterlab_nvdashboard": False},
    )

    payload = lab.get("devices").json()
    assert payload["source"] == "nvml"
    [device] = payload["devices"]
    assert device["uuid"] == mig and device["mig"] is True
    assert device["name"] == "NVIDIA A100-SXM4-80GB MIG 2g.20gb"
    assert device["memory_total_mib"] == 19968
    samples = wait_for("a sample", lambda: lab.get("samples").json()["samples"], timeout=30)
    figures = samples[-1]["devices"][mig]
    assert figures["memory_used_mib"] == 7000 and figures["utilization_pct"] is None
