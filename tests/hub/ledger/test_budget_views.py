"""GPU-hours and GPU-hour budgets as admins and users see them, on a real hub whose ledger holds
five days of seeded history: the admin budgets endpoint, the picker's budget line, and the admin
panel's top consumers, budgets and usage CSV in a real browser.

The history (GPU-hours, all closed, in the 30-day budget window; D = a day before the seeding):

    carol         1/4 GPU   5.5 D ago for 8 h   2 GPU-h
    alice (ml)    1 GPU     3.5 D ago for 10 h  10 GPU-h (0.5 of them used: the monitor saw it)
    bob (ml)      1 GPU     2.5 D ago for 6 h   6 GPU-h (an external pod: unmonitored, not idle)
    alice (ml)    1/2 GPU   1.5 D ago for 4 h   2 GPU-h

and the budgets: alice 100, bob 7, carol 2, dave 50, group ml 20 (warning at 80 %).
"""

from __future__ import annotations

import csv
import io
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from traitlets.config import Config

from gpulab.hub.ledger import UsageSample
from gpulab.hub.scopes import ADMIN_READ
from tests.harness.browser import log_in_as_admin
from tests.harness.hub import Hub
from tests.harness.ledger import Held, seed_ledger
from tests.harness.wait import wait_for

DAY, HOUR = 86400, 3600
ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parents[1] / "artifacts"))
WINDOW_POINTS = 31  # the window's start, each of its 30 days, and now


def _history(now: int) -> tuple[list[Held], list[UsageSample]]:
    alice_start = now - int(3.5 * DAY)
    held = [
        Held("carol", (), 250, now - int(5.5 * DAY), 8 * HOUR),
        Held("alice", ("ml",), 1000, alice_start, 10 * HOUR),
        Held(
            "bob",
            ("ml",),
            1000,
            now - int(2.5 * DAY),
            6 * HOUR,
            "GPU-seeded-1",
            workload="external",
        ),
        Held("alice", ("ml",), 500, now - int(1.5 * DAY), 4 * HOUR),
    ]
    # half an hour of the device busy, in the second hour of alice's first interval
    hour = (alice_start // HOUR + 1) * HOUR
    used = [UsageSample("alice", "", "GPU-seeded-0", hour, 1800.0, 3600.0)]
    return held, used


@pytest.fixture(scope="module")
def hub(make_module_hub: Any) -> Hub:
    c = Config()
    c.GPUCapacity.declared_inventory = "2 x A100-SXM4-80GB"
    c.GPULedger.hour_quota_users = {"alice": 100, "bob": 7, "carol": 2, "dave": 50}
    c.GPULedger.hour_quota_groups = {"ml": 20}
    c.GPULedger.budget_check_interval_seconds = 1
    c.JupyterHub.load_roles.extend(
        [{"name": "gpu-viewer", "scopes": [ADMIN_READ], "users": ["viewer"]}]
    )
    hub = make_module_hub(c, start=False)
    seed_ledger(hub.state_dir, *_history(int(time.time())))
    hub.start()
    hub.create_user("alice", groups=("ml",))
    hub.create_user("bob", groups=("ml",))
    for user in ("carol", "dave", "erin"):
        hub.create_user(user)
    return hub


def _token(hub: Hub, user: str) -> httpx.Client:
    hub.create_user(user)
    r = hub.api("POST", f"/users/{user}/tokens", json={"note": "budget views test"})
    assert r.status_code == 201, r.text
    return httpx.Client(
        base_url=f"{hub.url}/hub/api",
        headers={"Authorization": f"token {r.json()['token']}"},
        timeout=60,
    )


# -- GET /hub/api/gpulab/admin/budgets ------------------------------------------------------------


def test_the_budgets_endpoint_gives_every_budgets_standing_and_daily_burn_down(hub):
    r = _token(hub, "viewer").get("/gpulab/admin/budgets")
    assert r.status_code == 200, r.text
    body = r.json()
    window = body["window"]
    assert (window["days"], window["warn_percent"]) == (30, 80)
    assert body["generated_at"] == window["until"]

    budgets = {(b["scope"], b["name"]): b for b in body["budgets"]}
    assert list(budgets) == [
        ("user", "alice"),
        ("user", "bob"),
        ("user", "carol"),
        ("user", "dave"),
        ("group", "ml"),
    ]
    standing = {
        key: (
            b["limit_gpu_hours"],
            b["allocated_gpu_hours"],
            b["remaining_gpu_hours"],
            b["state"],
            b["users"],
        )
        for key, b in budgets.items()
    }
    assert standing == {
        ("user", "alice"): (100, 12, 88, "ok", ["alice"]),
        ("user", "bob"): (7, 6, 1, "warn", ["bob"]),
        ("user", "carol"): (2, 2, 0, "exhausted", ["carol"]),
        ("user", "dave"): (50, 0, 50, "ok", []),
        ("group", "ml"): (20, 18, 2, "warn", ["alice", "bob"]),
    }

    def left(key: tuple[str, str]) -> list[float]:
        return [p["remaining_gpu_hours"] for p in budgets[key]["burn_down"]]

    # a point at the window's start, one a day (the history lies half a day from them) and now
    assert left(("user", "alice")) == [100] * 27 + [90, 90, 88, 88]
    assert left(("group", "ml")) == [20] * 27 + [10, 4, 2, 2]
    assert left(("user", "carol")) == [2] * 25 + [0] * 6
    assert left(("user", "dave")) == [50] * WINDOW_POINTS
    times = [p["t"] for p in budgets[("user", "alice")]["burn_down"]]
    assert (times[0], times[-1]) == (window["since"], window["until"])
    assert times[1][:10] > times[0][:10]


def test_the_budgets_endpoint_filters_by_state_and_names_a_bad_one(hub):
    viewer = _token(hub, "viewer")
    r = viewer.get("/gpulab/admin/budgets", params={"state": "warn,exhausted"})
    assert r.status_code == 200, r.text
    assert [(b["scope"], b["name"]) for b in r.json()["budgets"]] == [
        ("user", "bob"),
        ("user", "carol"),
        ("group", "ml"),
    ]
    r = viewer.get("/gpulab/admin/budgets", params={"state": "broke"})
    assert r.status_code == 400
    assert r.json()["message"] == "state: expected some of ok, warn, exhausted, got 'broke'"


def test_the_budgets_endpoint_refuses_a_user_without_the_panels_scope(hub):
    r = _token(hub, "mallory").get("/gpulab/admin/budgets")
    assert r.status_code == 403
    assert ADMIN_READ in r.json()["message"]
    # alice may read her own budget, not everyone's
    assert _token(hub, "alice").get("/gpulab/admin/budgets").status_code == 403


# -- the profile picker ---------------------------------------------------------------------------


def _picker(hub: Hub, user: str) -> str:
    admin = hub.login("admin", hub.admin_password())
    r = admin.get(f"/hub/spawn/{user}")
    assert r.status_code == 200, r.text[-2000:]
    assert 'class="gpulab-picker"' in r.text
    return r.text


def _picker_once_budgets_are_counted(hub: Hub, user: str) -> str:
    """`user`'s picker once the ledger's first budget count after start-up has run."""

    def page() -> str | None:
        text = _picker(hub, user)
        return text if "gpulab-hour-budget" in text else None

    return wait_for(f"{user}'s GPU-hour budget in the picker", page, 30, 0.5)


def _profile_label(page: str, slug: str) -> str:
    found = re.search(rf'<label [^>]*for="profile-{slug}".*?</label>', page, re.S)
    assert found, slug
    return found.group(0)


def test_the_picker_shows_the_gpu_hours_left_of_the_tightest_budget(hub):
    line = '<p class="gpulab-hour-budget" data-exhausted="false">{}</p>'
    dave = _picker_once_budgets_are_counted(hub, "dave")
    assert line.format("GPU-hours: 50.0 of 50 left (30 days)") in dave
    assert "gpulab-hour-budget-refusal" not in dave
    # alice has 88 of her own 100 left, but her group ml only 2 of 20: the group's decides
    alice = _picker(hub, "alice")
    assert line.format("GPU-hours: 2.0 of 20 left (30 days, group ml)") in alice
    assert "disabled" not in _profile_label(alice, "gpu-quarter")
    # no budget binds erin: no line at all
    assert "gpulab-hour-budget" not in _picker(hub, "erin")


def test_the_picker_says_an_exhausted_budget_refuses_gpu_profiles_and_leaves_cpu_open(hub):
    carol = _picker_once_budgets_are_counted(hub, "carol")
    assert (
        '<p class="gpulab-hour-budget" data-exhausted="true">GPU-hours: 0.0 of 2 left (30 days)</p>'
    ) in carol
    refusal = re.search(
        r'<div class="alert alert-danger gpulab-hour-budget-refusal".*?</div>', carol, re.S
    )
    assert refusal, carol
    text = " ".join(re.sub(r"<[^>]+>", " ", refusal.group(0)).split())
    assert text == (
        "GPU-hour budget used up (carol: 2.0 of 2 GPU-hours allocated, 0.0 left in the last "
        "30 days). GPU profiles cannot start until older GPU-hours leave the window; a CPU-only "
        "profile needs none."
    )
    quarter = _profile_label(carol, "gpu-quarter")
    assert "disabled" in quarter and "Your GPU-hour budget is used up" in quarter
    assert "disabled" not in _profile_label(carol, "cpu")
    # and the hub refuses what the picker closed, with the same sentence
    r = hub.spawn("carol", profile="gpu-quarter")
    assert r.status_code == 403
    assert "GPU-hour budget used up (carol: 2.0 of 2 GPU-hours allocated" in r.json()["message"]


# -- the admin panel in a browser -----------------------------------------------------------------


def _painted_pixels(locator: Any) -> int:
    """How many pixels of a chart's canvas chart.js has drawn on (0: an empty canvas)."""
    return int(
        locator.evaluate(
            """canvas => {
                const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
                let n = 0;
                for (let i = 3; i < d.length; i += 4) { if (d[i] > 0) { n++; } }
                return n;
            }"""
        )
    )


def test_the_panel_charts_top_consumers_and_budgets_and_exports_the_usage_csv(hub, page, tmp_path):
    log_in_as_admin(page, hub)
    page.goto(f"{hub.url}/hub/gpulab/admin")

    top = page.get_by_role("region", name="Top consumers")
    chart = top.get_by_role("img", name="Top consumers by GPU-hours")
    chart.wait_for(timeout=30_000)
    assert chart.get_attribute("aria-label") == (
        "Top consumers by GPU-hours (last 7 days): "
        "alice: 12.0 allocated, 0.5 used, 11.5 idle, 0 unmonitored; "
        "bob: 6.0 allocated, 0 used, 0 idle, 6.0 unmonitored; "
        "carol: 2.0 allocated, 0 used, 2.0 idle, 0 unmonitored"
    )
    assert _painted_pixels(chart) > 500

    budgets = page.get_by_role("region", name="GPU-hour budgets")
    table = budgets.get_by_role("table", name="Budgets")
    carol = table.get_by_role("row", name="Budget user carol")
    carol.wait_for(timeout=30_000)
    cells = [c.strip() for c in carol.locator("td").all_inner_texts()[:5]]
    assert cells == ["user carol", "2.0", "2.0", "0", "exhausted"]
    ml = table.get_by_role("row", name="Budget group ml")
    assert [c.strip() for c in ml.locator("td").all_inner_texts()[1:5]] == [
        "20.0",
        "18.0",
        "2.0",
        "warn",
    ]
    assert "alice, bob" in ml.inner_text()
    burn = ml.get_by_role("img", name="Burn-down of group ml")
    assert burn.get_attribute("aria-label") == (
        f"Burn-down of group ml: 20.0 to 2.0 GPU-hours left over {WINDOW_POINTS} points"
    )
    assert _painted_pixels(burn) > 200
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "admin-panel-budgets.png"), full_page=True)

    budgets.get_by_label("Over quota only (warn or exhausted)").check()
    table.get_by_role("row", name="Budget user alice").wait_for(state="detached")
    names = table.locator("tbody tr").evaluate_all("rows => rows.map(r => r.ariaLabel)")
    assert names == ["Budget user bob", "Budget user carol", "Budget group ml"]

    with page.expect_download() as download_info:
        top.get_by_role("link", name="Export GPU-hours CSV").click()
    target = tmp_path / "gpu-hours.csv"
    download_info.value.save_as(target)
    rows = list(csv.DictReader(io.StringIO(target.read_text())))
    assert list(rows[0]) == [
        "bucket",
        "user",
        "profile",
        "allocated_gpu_hours",
        "used_gpu_hours",
        "idle_gpu_hours",
        "unmonitored_gpu_hours",
    ]
    allocated: dict[tuple[str, str], float] = {}
    for row in rows:
        key = (row["user"], row["profile"])
        allocated[key] = allocated.get(key, 0.0) + float(row["allocated_gpu_hours"])
    assert allocated == pytest.approx(
        {("alice", "gpu-1"): 12.0, ("bob", "gpu-1"): 6.0, ("carol", "gpu-1"): 2.0}
    )
    # bob's external GPU pod: all of its hours unmonitored, none called idle
    bob_rows = [r for r in rows if r["user"] == "bob"]
    assert sum(float(r["unmonitored_gpu_hours"]) for r in bob_rows) == pytest.approx(6.0)
    assert sum(float(r["idle_gpu_hours"]) for r in bob_rows) == 0

    # the last 24 hours hold none of the history
    top.get_by_label("GPU-hours window").select_option("24h")
    top.get_by_text("No GPU-hours in the last 24 h.").wait_for(timeout=30_000)
