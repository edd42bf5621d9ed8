"""In a real browser: the picker closes what the quota cannot fit, saying why, and a start refused
after the form was sent shows its reason to the person (not only in the hub's log)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from traitlets.config import Config

from tests.harness.browser import log_in_as_admin

ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))

# slow_spawn_timeout 0: the form's start always goes on behind the progress page, so the refusal
# reaches the person through JupyterHub's progress events
OVERLAY = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})
OVERLAY.JupyterHub.tornado_settings.update({"slow_spawn_timeout": 0})


def _servers(hub) -> dict:
    return hub.api("GET", "/users/admin", params={"include_stopped_servers": "1"}).json()["servers"]


def test_person_sees_why_a_gpu_start_was_refused(make_hub, page, tmp_path):
    hub = make_hub(OVERLAY)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log_in_as_admin(page, hub)
    page.goto(f"{hub.url}/hub/spawn/admin/more")
    page.check("#profile-gpu-half")

    # meanwhile another of the person's servers takes the whole 1-GPU quota
    hub.start_server("admin", "other", profile="gpu-1")
    page.click("form button[type=submit], form input[type=submit]")
    # the refusal shows on the progress page, or on the "Spawn failed" page when it came
    # before the progress page loaded: either way with the reason, not only "Spawn failed"
    page.get_by_text("GPU quota exceeded").first.wait_for(timeout=60_000)
    assert (
        "GPU quota exceeded: User 'admin' asks for 0.5 GPU but has 0 GPU of a 1 GPU budget "
        "left. Stop one of your GPU servers, or a CPU-only server ('cpu')."
    ) in " ".join(page.inner_text("body").split())
    page.screenshot(path=str(ARTIFACTS / "refused-start.png"), full_page=True)
    # the refused first start leaves no record once the person has been told why: the page
    # that reports it (the refusal may reach the hub's bookkeeping a moment after the page
    # showed it, so the person's next look at that page is what removes the record)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and set(_servers(hub)) != {"", "other"}:
        page.goto(f"{hub.url}/hub/spawn-pending/admin/more")  # a GET: nothing resubmitted
        time.sleep(0.5)
    assert set(_servers(hub)) == {"", "other"}

    # the picker now closes the GPU profiles and says why; CPU only stays open
    page.goto(f"{hub.url}/hub/spawn/admin/more")
    reason = page.locator("label[for=profile-gpu-quarter] .gpulab-closed-reason")
    assert reason.inner_text() == "Needs 0.25 GPU; your GPU quota has 0 GPUs left"
    assert page.locator("#profile-gpu-quarter").is_disabled()
    assert page.locator("#profile-cpu").is_enabled()
    page.screenshot(path=str(ARTIFACTS / "picker-over-quota.png"), full_page=True)

    assert set(hub.allocations()) == {"admin/other"}
