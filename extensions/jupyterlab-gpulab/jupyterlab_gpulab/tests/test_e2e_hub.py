"""Through a real hub: a token that may access a spawned server reads its GPU metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from traitlets.config import Config

from tests.harness.labserver import EXTENSION_SRC


def test_a_quarter_share_servers_gpu_metrics_are_read_through_the_hub(
    make_hub, tmp_path: Path
) -> None:
    # enabled and imported from the source folder, whether or not the venv holds a built copy
    enable = tmp_path / "jupyter-config" / "jupyter_server_config.d" / "jupyterlab_gpulab.json"
    enable.parent.mkdir(parents=True)
    enable.write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"jupyterlab_gpulab": True}}})
    )
    # no monitor source set: the stock hub's default simulates a declared inventory's GPUs
    env = {
        "PYTHONPATH": str(EXTENSION_SRC),
        "JUPYTER_CONFIG_PATH": str(enable.parents[1]),
    }
    overlay = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})
    overlay.Spawner.environment.update(env)
    hub = make_hub(overlay)
    hub.create_user("ada")
    hub.start_server("ada", profile="gpu-quarter")
    (uuid,) = hub.server_env("ada")["GPULAB_GPU_UUIDS"].split(",")
    base = f"{hub.url}/user/ada/gpulab/monitor"
    with httpx.Client(headers={"Authorization": f"token {hub.token}"}, timeout=30) as reader:
        devices = reader.get(f"{base}/devices").json()
        assert devices["share"]["fraction"] == 0.25 and devices["share"]["profile"] == "gpu-quarter"
        assert devices["simulated"] and "Simulated" in devices["message"]
        (device,) = devices["devices"]
        assert device["uuid"] == uuid and not device["whole"]
        assert device["name"] == "Simulated NVIDIA A100-SXM4-80GB"  # the model the hub placed
        assert device["memory_total_mib"] == 81920 and device["memory_limit_mib"] == 20480
        text = ""
        for _ in range(100):
            text = reader.get(f"{base}/metrics").text
            if "gpulab_gpu_memory_used_bytes{" in text:
                break
        limit = f'gpulab_gpu_memory_limit_bytes{{gpu="{uuid}",server="",user="ada"}}'
        assert limit in text
        assert "gpulab_gpu_temperature_celsius{" not in text, "a shared GPU has no temperature"
    anonymous = httpx.get(f"{base}/metrics", timeout=30, follow_redirects=False)
    assert anonymous.status_code in (302, 403)
    assert "gpulab_gpu" not in anonymous.text

    # a CPU-only server of the same hub shows no GPU (and pushes none to gpulab-metrics)
    hub.create_user("cyd")
    hub.start_server("cyd", profile="cpu")
    cpu = httpx.get(
        f"{hub.url}/user/cyd/gpulab/monitor/devices",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    ).json()
    assert cpu["devices"] == [] and "no GPU" in cpu["message"]
