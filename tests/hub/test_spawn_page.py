"""In a real browser: log in, read the picker, start a 1/2-GPU server, land in JupyterLab."""

from __future__ import annotations

import os
from pathlib import Path

from traitlets.config import Config

from tests.harness.browser import log_in_as_admin

ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))


def test_person_logs_in_picks_half_a_gpu_and_lands_in_jupyterlab(make_hub, page, tmp_path):
    hub = make_hub(Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"}))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log_in_as_admin(page, hub)

    half = page.locator("label[for=profile-gpu-half]")
    assert "(1/2 GPU - 4 free)" in half.inner_text()
    assert "declared" in page.locator(".gpulab-inventory").inner_text()
    page.screenshot(path=str(ARTIFACTS / "picker.png"), full_page=True)

    page.check("#profile-gpu-half")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    page.wait_for_selector(".jp-LabShell", timeout=90_000)
    page.wait_for_selector(".jp-Launcher", timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "jupyterlab.png"))

    assert [g["milli"] for g in hub.allocations()["admin/"]["gpus"]] == [500]
    assert hub.capacity()["gpu-half"]["label"] == "1/2 GPU - 3 free"
