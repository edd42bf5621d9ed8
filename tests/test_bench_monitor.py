"""bench.monitor's parts: the cited NVML cost table, and its anchor, jupyterlab-nvdashboard's own
handlers, running over the labelled fake pynvml with the same lag probe as every server."""

from __future__ import annotations

import asyncio
import json

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from bench.monitor import COSTS, GPUS, fake_machine
from tests.harness import fake_nvml
from tests.harness.labserver import EXTENSION_SRC, REPO
from tests.harness.wait import wait_for


def _entries(table: dict) -> dict[str, dict]:
    return {"default": table["default"], **table["calls"]}


def test_every_nvml_cost_the_bench_charges_is_cited_or_labelled_an_assumption():
    table = json.loads(COSTS.read_text())
    for name, entry in _entries(table).items():
        assert entry["kind"] in ("cpu", "wait"), name
        assert float(entry["seconds"]) >= 0, name
        source, assumption = entry.get("source"), entry.get("assumption", "")
        assert (source and source["url"].startswith("https://") and source["says"]) or (
            len(assumption) > 40
        ), f"{name}: neither a source nor a reasoned assumption"


def test_the_fake_driver_accepts_the_cost_table():
    with fake_nvml.installed(fake_machine()) as nvml:
        nvml.load_costs(json.loads(COSTS.read_text()))
        nvml.load_costs({"calls": {}})  # free again: this test times nothing
        nvml.nvmlInit()
        assert nvml.nvmlDeviceGetCount() == GPUS


async def test_nvdashboards_own_handlers_serve_the_fake_gpus_and_the_probe_measures_its_loop(
    make_lab_server, tmp_path
):
    env = fake_nvml.subprocess_env(
        fake_machine(), tmp_path / "machine.json", pythonpath=f"{EXTENSION_SRC}:{REPO}"
    )
    lab = make_lab_server(
        env=env,
        extensions={
            "jupyterlab_nvdashboard": True,
            "jupyterlab_gpulab": False,
            "bench._lag_probe": True,
        },
    )
    assert lab.client.get("/nvdashboard/accelerators/check").json()["ngpus"] == GPUS

    async def first_push(path: str) -> dict:
        request = HTTPRequest(f"{lab.ws_url}/nvdashboard/{path}", headers=lab.headers)
        ws = await websocket_connect(request)
        try:
            await ws.write_message(json.dumps({"updateFrequency": 100, "isPaused": False}))
            while True:
                body = json.loads(await asyncio.wait_for(ws.read_message(), 30))
                if "status" not in body:
                    return body
        finally:
            ws.close()

    utilization = await first_push("gpu_utilization")
    assert utilization["gpu_utilization"] == [g["utilization"] for g in fake_machine()["gpus"]]
    resources = await first_push("gpu_resource")  # reads PCIe throughput too: pcie_gen is set
    assert len(resources["gpu_memory_individual"]) == GPUS and "rx_total" in resources
    lags = wait_for("loop lags", lambda: lab.client.get("/bench/lag").json()["lags_ms"], 30)
    assert all(lag >= 0 for lag in lags)
