"""Through a real hub: a server's gpulab/budget answers its owner's GPU-hour budget, from the hub,
with the server's own token, and never anyone else's; the lab shows it in the GPU panel and the
job form."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
from traitlets.config import Config

from jupyterlab_gpulab.budget import budget_reply
from tests.harness.browser import log_in_as_admin, run_from_palette
from tests.harness.jobs import put
from tests.harness.labserver import EXTENSION_SRC

ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))


def test_a_servers_budget_route_answers_its_owners_budget_only(make_hub, tmp_path: Path) -> None:
    # enabled and imported from the source folder, whether or not the venv holds a built copy
    enable = tmp_path / "jupyter-config" / "jupyter_server_config.d" / "jupyterlab_gpulab.json"
    enable.parent.mkdir(parents=True)
    enable.write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"jupyterlab_gpulab": True}}})
    )
    overlay = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})
    overlay.Spawner.environment.update(
        {"PYTHONPATH": str(EXTENSION_SRC), "JUPYTER_CONFIG_PATH": str(enable.parents[1])}
    )
    overlay.GPULedger.hour_quota_users = {"alice": 10, "bob": 3}
    hub = make_hub(overlay)
    for user in ("alice", "bob", "carol"):
        hub.create_user(user)
    hub.start_server("alice", profile="cpu")
    hub.start_server("carol", profile="cpu")

    with httpx.Client(headers={"Authorization": f"token {hub.token}"}, timeout=30) as reader:
        alice = reader.get(f"{hub.url}/user/alice/gpulab/budget")
        assert alice.status_code == 200, alice.text
        assert alice.json() == {
            "budget": {
                "scope": "user",
                "name": "alice",
                "limit_gpu_hours": 10,
                "allocated_gpu_hours": 0,
                "remaining_gpu_hours": 10,
                "state": "ok",
                "window_days": 30,
            },
            "line": "GPU-hours left: 10.0 of 10 (30 days)",
        }
        # the route names no user: asking alice's server for bob's budget still gives alice's
        asked_for_bob = reader.get(f"{hub.url}/user/alice/gpulab/budget", params={"user": "bob"})
        assert asked_for_bob.json() == alice.json()
        # no budget binds carol: nothing to show
        carol = reader.get(f"{hub.url}/user/carol/gpulab/budget")
        assert carol.json() == {"budget": None, "line": None}

    # and the token alice's server holds cannot read bob's figures from the hub either
    token = hub.server_env("alice")["JUPYTERHUB_API_TOKEN"]
    own = httpx.get(
        f"{hub.url}/hub/api/gpulab/users/alice/usage",
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )
    assert own.status_code == 200 and own.json()["budget_window_days"] == 30
    other = httpx.get(
        f"{hub.url}/hub/api/gpulab/users/bob/usage",
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )
    assert other.status_code == 404
    assert "limit_gpu_hours" not in other.text


def test_the_tightest_budget_decides_and_a_group_budget_names_its_group() -> None:
    usage = {
        "budget_window_days": 7,
        "budgets": [
            {"scope": "user", "name": "ada", "limit_gpu_hours": 100, "remaining_gpu_hours": 88.0},
            {"scope": "group", "name": "ml", "limit_gpu_hours": 20, "remaining_gpu_hours": 2.25},
        ],
    }
    reply = budget_reply(usage)
    assert reply["budget"]["name"] == "ml" and reply["budget"]["window_days"] == 7
    assert reply["line"] == "GPU-hours left: 2.2 of 20 (7 days, group ml)"
    assert budget_reply({"budgets": []}) == {"budget": None, "line": None}


def test_the_lab_shows_the_budget_in_the_gpu_panel_and_the_job_form(make_hub, page) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    overlay = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})
    overlay.GPULedger.hour_quota_users = {"admin": 40}
    hub = make_hub(overlay)
    log_in_as_admin(page, hub)
    page.check("#profile-cpu")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    put(hub, "admin", "hello.py", "print('hello')\n")
    expected = "GPU-hours left: 40.0 of 40 (30 days)"
    try:
        page.goto(f"{hub.url}/user/admin/lab/tree/hello.py")
        page.wait_for_selector(".jp-FileEditor", timeout=60_000)

        run_from_palette(page, "GPU Monitor")
        budget = page.locator("[data-testid=gpulab-monitor] [data-testid=gpulab-budget]")
        budget.wait_for(state="visible", timeout=30_000)
        assert budget.inner_text() == expected
        assert budget.get_attribute("data-state") == "ok"

        page.goto(f"{hub.url}/user/admin/lab/tree/hello.py")
        page.wait_for_selector(".jp-FileEditor", timeout=60_000)
        run_from_palette(page, "Submit as GPU Job")
        line = page.locator(".jp-Dialog [data-testid=gpulab-submit-budget]")
        line.wait_for(state="visible", timeout=30_000)
        assert line.inner_text() == expected
        page.screenshot(path=str(ARTIFACTS / "lab-budget.png"))
        page.locator(".jp-Dialog .jp-mod-reject").click()
    finally:
        hub.stop_server("admin")
