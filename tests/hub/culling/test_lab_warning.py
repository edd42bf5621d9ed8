"""The culling warning as a person meets it: JupyterLab in Chromium shows it before an idle GPU
server is culled, and its "Keep alive" keeps the server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.harness.browser import log_in_as_admin
from tests.harness.culler import (
    CHECK_INTERVAL_SECONDS,
    culling,
    culling_policy,
    decision_of,
    make_culling_hub,
)
from tests.harness.wait import wait_for

#: long enough for a person (and a loaded machine's Chromium) to see the warning and click
WARN_SECONDS = 45


def test_the_warning_shows_in_jupyterlab_and_keep_alive_keeps_the_server(
    make_hub: Any, page: Any, tmp_path: Path, shared_dir: Path
) -> None:
    policy = culling_policy(dry_run=False, warn_seconds=WARN_SECONDS)
    hub = make_culling_hub(make_hub, tmp_path, shared_dir, policy)
    log_in_as_admin(page, hub)
    page.check("#profile-gpu-quarter")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    page.wait_for_selector(".jp-LabShell", timeout=60_000)

    # nobody touches the lab: the GPU stays at 0 % and the hub warns
    toast = page.locator(".Toastify__toast", has_text="Idle GPU server")
    toast.wait_for(timeout=90_000)
    text = toast.inner_text()
    assert "it will be stopped" in text and "unless you use it" in text
    warned = decision_of(hub, "admin")
    assert warned is not None and warned["verdict"] in ("warn", "wait"), warned
    assert toast.get_by_role("button", name="Switch to CPU").is_visible()

    toast.get_by_role("button", name="Keep alive").click()
    page.locator(".Toastify__toast", has_text="Kept alive").wait_for(timeout=30_000)

    def kept() -> dict[str, Any] | None:
        d = decision_of(hub, "admin")
        return d if d and d["verdict"] == "exempt" and d["causes"][0] == "keep-alive" else None

    wait_for("the keep-alive exemption", kept, 30, 0.5)
    (withdrawal,) = [
        d
        for d in culling(hub)["recent_actions"]
        if d["user"] == "admin" and d["effect"] == "withdraw-warning"
    ]
    assert withdrawal["reason"].startswith("warning withdrawn: kept alive by its user for")
    # every warning toast goes (one being dismissed may still animate out beside another: count)
    warnings = page.locator(".Toastify__toast", has_text="Idle GPU server")
    wait_for("the warning toasts to go", lambda: warnings.count() == 0 or None, 30, 0.3)
    # past the warning's end, the server still runs
    time.sleep(max(0.0, warned["deadline"] - time.time()) + 3 * CHECK_INTERVAL_SECONDS)
    model = hub.server_model("admin")
    assert model is not None and model["ready"], hub.log()[-3000:]
    assert decision_of(hub, "admin")["verdict"] == "exempt"
