"""Which devices and share a server has, and what each source reports for them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from traitlets import TraitError

from jupyterlab_gpulab.monitor import GPUMonitor
from jupyterlab_gpulab.share import is_mig_uuid, share_from_env
from jupyterlab_gpulab.sources import (
    NO_DRIVER_MESSAGE,
    Latencies,
    NoDriverSource,
    NvmlSource,
    SimulatedSource,
    select_source,
)

FREE = Latencies(utilization=0, memory=0, processes=0)
QUARTER = {
    "GPULAB_GPU_UUIDS": "GPU-6f0b7c1e-aaaa-bbbb-cccc-000000000001",
    "GPULAB_GPU_FRACTION": "0.250",
    "GPULAB_GPU_MEMORY_LIMIT_MIB": "20389",
    "GPULAB_GPU_ENFORCEMENT": "framework-caps",
    "GPULAB_PROFILE": "gpu-quarter",
    "JUPYTERHUB_USER": "ada",
    "JUPYTERHUB_SERVER_NAME": "train",
}


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_a_whole_gpu_share_has_no_fraction_and_the_device_total_as_limit() -> None:
    share = share_from_env({"GPULAB_GPU_UUIDS": "GPU-a,GPU-b", "GPULAB_PROFILE": "gpu-2x"})
    assert share.uuids == ("GPU-a", "GPU-b")
    assert share.whole and share.fraction is None and share.memory_limit_mib is None
    assert share.enforcement == "exclusive"
    source = SimulatedSource(share, latencies=FREE)
    assert [d.memory_limit_mib for d in source.devices()] == [81559.0, 81559.0]
    assert all(d.whole for d in source.devices())


def test_a_quarter_share_reads_fraction_limit_user_and_server_from_the_environment() -> None:
    share = share_from_env(QUARTER)
    assert share.fraction == 0.25 and share.memory_limit_mib == 20389.0
    assert (share.user, share.server, share.profile) == ("ada", "train", "gpu-quarter")
    assert share.to_json() == {
        "profile": "gpu-quarter",
        "fraction": 0.25,
        "memory_limit_mib": 20389.0,
        "enforcement": "framework-caps",
        "model": "",
    }
    (device,) = SimulatedSource(share, latencies=FREE).devices()
    assert not device.whole and device.memory_limit_mib == 20389.0
    sample = SimulatedSource(share, latencies=FREE).sample()[device.uuid]
    assert sample.temperature_c is None and sample.power_w is None, "neighbours share the sensors"
    assert sample.memory_limit_mib == 20389.0 and sample.memory_used_mib <= 20389.0


def test_a_bad_fraction_names_the_variable() -> None:
    with pytest.raises(ValueError, match="GPULAB_GPU_FRACTION='quarter'"):
        share_from_env({"GPULAB_GPU_UUIDS": "GPU-a", "GPULAB_GPU_FRACTION": "quarter"})


def test_mig_uuids_in_the_environment_become_mig_devices_without_sensors() -> None:
    env = {
        "GPULAB_GPU_UUIDS": " MIG-4f1c2d3e-0000-5555-9999-aaaaaaaaaaaa , MIG-GPU-1234/1/0,MIG-GPU-1234/1/0"
    }
    share = share_from_env(env)
    assert share.uuids == ("MIG-4f1c2d3e-0000-5555-9999-aaaaaaaaaaaa", "MIG-GPU-1234/1/0")
    assert all(is_mig_uuid(u) for u in share.uuids) and not is_mig_uuid("GPU-1234")
    source = SimulatedSource(share, latencies=FREE)
    assert [(d.mig, d.whole) for d in source.devices()] == [(True, False), (True, False)]
    sample = source.sample()
    assert all(s.temperature_c is None for s in sample.values())
    assert source.calls["nvmlDeviceGetTemperature"] == 0


def test_without_a_driver_auto_reports_none_with_a_message(tmp_path: Path) -> None:
    if nvml_works():
        pytest.skip("an NVIDIA driver is present here: auto picks NVML")
    share = share_from_env(QUARTER)
    source = select_source("auto", share)
    assert isinstance(source, NoDriverSource)
    assert source.message == NO_DRIVER_MESSAGE
    with pytest.raises(Exception):  # noqa: B017 - whatever pynvml raises without a driver
        NvmlSource(share)
    monitor = GPUMonitor(share=share, rules_file=str(tmp_path / "rules.txt"))
    payload = monitor.devices_payload()
    assert payload["source"] == "none" and payload["simulated"] is False
    assert payload["message"] == NO_DRIVER_MESSAGE and payload["devices"] == []


def test_the_environment_switches_simulation_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPULAB_MONITOR_SOURCE", "simulated")
    monitor = GPUMonitor(share=share_from_env(QUARTER), rules_file=str(tmp_path / "r.txt"))
    payload = monitor.devices_payload()
    assert payload["source"] == "simulated" and payload["simulated"] is True
    assert "Simulated" in payload["message"] and "Shared GPU" in payload["message"]
    assert payload["devices"][0]["uuid"] == QUARTER["GPULAB_GPU_UUIDS"]


def test_monitor_options_are_validated_with_their_names() -> None:
    with pytest.raises(TraitError, match="GPUMonitor.period_seconds=0.1"):
        GPUMonitor(period_seconds=0.1, source="none")
    with pytest.raises(TraitError, match="GPUMonitor.source='cuda'"):
        GPUMonitor(source="cuda")
    with pytest.raises(TraitError, match="unknown simulated latency"):
        GPUMonitor(source="none", simulated_latencies={"fan": 1e-6})
    with pytest.raises(TraitError, match="GPUMonitor.process_list_seconds=nan"):
        GPUMonitor(source="none", process_list_seconds=float("nan"))


def test_scripted_figures_file_drives_the_simulation_and_is_reread_on_change(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gpus.json"
    share = share_from_env({"GPULAB_GPU_UUIDS": "GPU-a,GPU-b"})
    source = SimulatedSource(share, latencies=FREE, script_path=path)
    assert source.sample()["GPU-a"].processes[0].own  # no file yet: the random walk
    path.write_text(
        json.dumps(
            {"*": {"utilization_pct": 3}, "GPU-b": {"utilization_pct": 97, "temperature_c": 88}}
        )
    )
    first = source.sample()
    assert first["GPU-a"].utilization_pct == 3 and first["GPU-b"].utilization_pct == 97
    assert first["GPU-b"].temperature_c == 88
    path.write_text(
        json.dumps(
            {
                "GPU-a": {
                    "utilization_pct": 55.5,
                    "processes": [{"pid": 4242, "memory_mib": 100, "own": False, "name": "other"}],
                }
            }
        )
    )
    os.utime(path, ns=(1, 1))  # a new stamp even on a coarse-mtime filesystem
    second = source.sample()
    assert second["GPU-a"].utilization_pct == 55.5
    assert [(p.pid, p.own, p.name) for p in second["GPU-a"].processes] == [(4242, False, "other")]
    path.write_text("{not json")
    os.utime(path, ns=(2, 2))
    third = source.sample()
    assert third["GPU-a"].utilization_pct == 55.5, "a broken file keeps the last good figures"
    assert str(path) in source.message


def test_metrics_carry_the_fixed_names_and_labels(tmp_path: Path) -> None:
    share = share_from_env(QUARTER)
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"*": {"utilization_pct": 40, "memory_used_mib": 1024}}))
    source = SimulatedSource(share, latencies=FREE, script_path=path)
    monitor = GPUMonitor(share=share, src=source, rules_file=str(tmp_path / "r.txt"))
    monitor.sampler.sample_once()
    text = monitor.metrics_text().decode()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = (("gpu", QUARTER["GPULAB_GPU_UUIDS"]), ("server", "train"), ("user", "ada"))
    assert values[("gpulab_gpu_utilization_ratio", labels)] == 0.4
    assert values[("gpulab_gpu_memory_used_bytes", labels)] == 1024 * 1024 * 1024
    assert values[("gpulab_gpu_memory_limit_bytes", labels)] == 20389 * 1024 * 1024
    own = [k for k in values if k[0] == "gpulab_gpu_process_memory_bytes"]
    assert own and all(dict(k[1])["pid"] for k in own)
    assert (
        values[("gpulab_monitor_simulated", (("gpu", ""), ("server", "train"), ("user", "ada")))]
        == 1
    )
    assert "gpulab_gpu_temperature_celsius" not in text, "a shared GPU has no temperature"


@pytest.mark.gpu
def test_nvml_reports_the_devices_this_machine_has(tmp_path: Path) -> None:
    if not nvml_works():
        pytest.skip("no NVIDIA driver here: pynvml.nvmlInit() fails")
    import pynvml

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    pynvml.nvmlShutdown()
    source = NvmlSource(share_from_env({"GPULAB_GPU_UUIDS": uuid}))
    try:
        (device,) = source.devices()
        assert device.uuid == uuid and device.whole and device.memory_total_mib > 1000
        sample = source.sample()[uuid]
        assert sample.utilization_pct is not None and 0 <= sample.utilization_pct <= 100
        assert 0 < sample.memory_used_mib <= device.memory_total_mib
        assert sample.temperature_c is not None and sample.power_w is not None
        quarter = NvmlSource(
            share_from_env(
                {
                    "GPULAB_GPU_UUIDS": uuid,
                    "GPULAB_GPU_FRACTION": "0.25",
                    "GPULAB_GPU_MEMORY_LIMIT_MIB": "1000",
                }
            )
        )
        (shared,) = quarter.devices()
        assert shared.memory_limit_mib == 1000 and not shared.whole
        assert quarter.sample()[uuid].temperature_c is None
        quarter.close()
    finally:
        source.close()
