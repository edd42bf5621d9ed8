"""In a real browser: the GPU monitor panel of a spawned server, on simulated GPUs the test drives.

The hub passes GPULAB_MONITOR_SOURCE=simulated and GPULAB_SIMULATED_GPU_FILE to the server; the
server's simulated source re-reads that file on every sample, so writing it moves the figures the
panel shows (utilisation, memory, processes) and the alerts the rules raise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from traitlets.config import Config

from tests.harness.browser import log_in_as_admin, run_from_palette
from tests.harness.hub import passable_dir

ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))


def _rule_language_missing() -> str | None:
    try:
        from gpulab.hub import alerts  # noqa: F401  (what the server extension imports)
    except ImportError as e:
        return f"gpulab's rule language (gpulab.hub.alerts) is not importable: {e}"
    return None


MONITOR = "[data-testid=gpulab-monitor]"
UTIL_CHART = f"{MONITOR} [data-testid=gpulab-util-chart]"
STATUS = "[data-testid=gpulab-status]"


def _write_figures(path: Path, **figures: Any) -> None:
    """Every simulated device reports these figures from the next sample on (atomic write)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"*": figures}))
    tmp.replace(path)


def _extension_installed() -> str | None:
    if importlib.util.find_spec("jupyterlab_gpulab") is None:
        return "jupyterlab-gpulab is not installed in this venv (bash .ci/dev setup installs it)"
    return None


def _spawn_lab(make_hub, tmp_path: Path, page: Any, source: str = "simulated") -> tuple[Any, Path]:
    """Log in and start a 1/2-GPU server on simulated devices; the hub and their figures file."""
    # read by the server's own account: beside the hubs' state, not in pytest's private tmp_path
    figures = passable_dir(tmp_path / "simulated") / "gpu-figures.json"
    _write_figures(
        figures,
        utilization_pct=20,
        memory_used_mib=10240,
        processes=[
            {"pid": 4242, "memory_mib": 10240, "own": True, "name": "python"},
            {"pid": 777, "memory_mib": 2048, "own": False, "name": ""},
        ],
    )
    env = {"GPULAB_MONITOR_SOURCE": source, "GPULAB_SIMULATED_GPU_FILE": str(figures)}
    overlay = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})
    overlay.Spawner.environment.update(env)
    hub = make_hub(overlay)
    log_in_as_admin(page, hub)
    page.check("#profile-gpu-half")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    page.wait_for_selector(".jp-Launcher", timeout=60_000)
    return hub, figures


def _open_monitor_from_palette(page: Any) -> None:
    # the command palette, as a person would: Ctrl+Shift+C, type, Enter
    run_from_palette(page, "GPU Monitor")
    page.wait_for_selector(MONITOR, timeout=30_000)


def _points(page: Any) -> int:
    return int(page.locator(UTIL_CHART).first.get_attribute("data-points") or 0)


@pytest.mark.skipif(_extension_installed() is not None, reason=_extension_installed() or "")
def test_monitor_panel_shows_the_share_and_live_charts_of_the_simulated_gpu(
    make_hub, page, tmp_path
):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    _, figures = _spawn_lab(make_hub, tmp_path, page)
    # the launcher and the GPU menu offer the panel; the palette opens it
    assert page.locator(".jp-LauncherCard", has_text="GPU Monitor").count() == 1
    page.locator(".lm-MenuBar-itemLabel", has_text="GPU").click()
    assert page.locator(".lm-Menu-itemLabel", has_text="GPU Monitor").is_visible()
    page.keyboard.press("Escape")
    _open_monitor_from_palette(page)
    panel = page.locator(MONITOR)

    assert panel.locator("[data-testid=gpulab-simulated-badge]").inner_text() == "SIMULATED devices"
    assert panel.locator("[data-testid=gpulab-share-fraction]").inner_text() == "1/2 GPU"
    assert panel.locator("[data-testid=gpulab-share-profile]").inner_text() == "gpu-half"
    assert panel.locator("[data-testid=gpulab-device]").count() == 1
    # the chart is drawn by uPlot (a canvas), and grows with every sample from the websocket
    assert panel.locator("[data-testid=gpulab-util-chart] canvas").count() >= 1
    page.wait_for_selector(f"{MONITOR} [data-testid=gpulab-connection][data-state=open]")
    before = _points(page)
    page.wait_for_function(
        "([sel, n]) => Number(document.querySelector(sel).dataset.points) >= n + 2",
        arg=[UTIL_CHART, before],
        timeout=30_000,
    )

    # the share's limit is half an 80 GB device; own processes are marked as such
    page.wait_for_function(
        "sel => /^GPU 20% · 10\\.0\\/40\\.0 GiB/.test(document.querySelector(sel).textContent)",
        arg=STATUS,
        timeout=30_000,
    )
    own = panel.locator("[data-testid=gpulab-process][data-own=true]")
    assert own.count() == 1 and "python (yours)" in own.inner_text()
    assert panel.locator("[data-testid=gpulab-process][data-own=false]").count() == 1

    # drive the simulated device; the status bar item and the figures follow
    _write_figures(figures, utilization_pct=73, memory_used_mib=12390)
    page.wait_for_function(
        "sel => document.querySelector(sel).textContent.startsWith('GPU 73% · 12.1/40.0 GiB')",
        arg=STATUS,
        timeout=30_000,
    )
    assert re.search(
        r"utilisation 73%", panel.locator("[data-testid=gpulab-device-figures]").inner_text()
    )
    page.screenshot(path=str(ARTIFACTS / "gpu-monitor.png"))

    # the status bar item brings the panel back once another tab hides it
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="Launcher").click()
    page.locator(MONITOR).wait_for(state="hidden")
    page.locator(STATUS).click()
    page.locator(MONITOR).wait_for(state="visible")

    # JupyterLab's dark theme: the panel follows the theme's colours
    light_bg = panel.evaluate("el => getComputedStyle(el).backgroundColor")
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
    page.locator(".lm-Menu-itemLabel", has_text="Theme").first.hover()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^JupyterLab Dark$")).click()
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
    page.wait_for_function(
        "([sel, bg]) => getComputedStyle(document.querySelector(sel)).backgroundColor !== bg",
        arg=[MONITOR, light_bg],
    )
    page.wait_for_selector("#jupyterlab-splash", state="detached")
    page.screenshot(path=str(ARTIFACTS / "gpu-monitor-dark.png"))


@pytest.mark.skipif(_extension_installed() is not None, reason=_extension_installed() or "")
@pytest.mark.skipif(_rule_language_missing() is not None, reason=_rule_language_missing() or "")
def test_user_adds_an_alert_rule_and_sees_it_fire_in_the_panel_and_as_a_notification(
    make_hub, page, tmp_path
):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    _, figures = _spawn_lab(make_hub, tmp_path, page)
    _open_monitor_from_palette(page)
    panel = page.locator(MONITOR)
    rule_input = panel.locator("[data-testid=gpulab-rule-input]")
    add = panel.locator("[data-testid=gpulab-rule-add]")
    error = panel.locator("[data-testid=gpulab-rule-error]")

    # a rule the server cannot parse: its message and position under the box
    rule_input.fill('IF gpu_utilization >> 80% FOR 3s THEN alert("HIGH_LOAD")')
    add.click()
    error.wait_for(state="visible")
    assert re.match(r"line 1, column \d+: ", error.inner_text()), error.inner_text()
    assert error.get_attribute("data-line") == "1"
    assert panel.locator("[data-testid=gpulab-rule]", has_text="HIGH_LOAD").count() == 0
    page.screenshot(path=str(ARTIFACTS / "gpu-monitor-rule-error.png"))

    rule_input.fill('IF gpu_utilization > 80% FOR 3s THEN alert("HIGH_LOAD")')
    add.click()
    panel.locator("[data-testid=gpulab-rule]", has_text="HIGH_LOAD").wait_for()
    assert error.is_hidden()
    assert rule_input.input_value() == ""
    assert panel.locator("[data-testid=gpulab-alert]").count() == 0

    _write_figures(figures, utilization_pct=95, memory_used_mib=8192)
    alert = panel.locator("[data-testid=gpulab-alert][data-state=firing]", has_text="HIGH_LOAD")
    alert.wait_for(timeout=60_000)
    toast = page.locator(".Toastify__toast", has_text="HIGH_LOAD")
    toast.first.wait_for(timeout=10_000)
    assert page.locator(STATUS).get_attribute("class").count("gpulab-mod-alert") == 1
    page.screenshot(path=str(ARTIFACTS / "gpu-monitor-alert.png"))

    # load goes down: the alert resolves and leaves the active list
    _write_figures(figures, utilization_pct=10, memory_used_mib=8192)
    alert.wait_for(state="detached", timeout=60_000)
    page.locator(
        "[data-testid=gpulab-alert-event][data-state=resolved]", has_text="HIGH_LOAD"
    ).first.wait_for()

    # the user's rule can be deleted again
    panel.locator("[data-testid=gpulab-rule]", has_text="HIGH_LOAD").locator(
        "[data-testid=gpulab-rule-delete]"
    ).click()
    panel.locator("[data-testid=gpulab-rule]", has_text="HIGH_LOAD").wait_for(state="detached")


def _server_sample_count(hub: Any) -> int:
    """Samples the server holds (all of them: it started well within its history window)."""
    r = httpx.get(
        f"{hub.url}/user/admin/gpulab/monitor/samples",
        params={"since": 0},
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return len(r.json()["samples"])


@pytest.mark.skipif(_extension_installed() is not None, reason=_extension_installed() or "")
def test_monitor_panel_reconnects_after_losing_its_websocket_and_backfills_the_gap(
    make_hub, page, tmp_path
):
    # The browser's websocket to gpulab/monitor/ws goes through this route: the test can drop it
    # and refuse new ones, as a flaky network or a proxy restart would.
    connections: list[Any] = []
    refused: list[Any] = []
    reachable = {"now": True}

    def route(ws: Any) -> None:
        if reachable["now"]:
            connections.append(ws)
            ws.connect_to_server()
        else:
            refused.append(ws)
            ws.close(code=1011, reason="test: the monitor is unreachable")

    page.route_web_socket(re.compile(r"/gpulab/monitor/ws"), route)
    hub, _ = _spawn_lab(make_hub, tmp_path, page)
    _open_monitor_from_palette(page)
    connection = f"{MONITOR} [data-testid=gpulab-connection]"
    page.wait_for_selector(f"{connection}[data-state=open]")

    reachable["now"] = False
    at_drop = _server_sample_count(hub)
    connections[-1].close(code=4000, reason="test: connection lost")
    page.wait_for_selector(f"{connection}[data-state=waiting]", timeout=30_000)
    assert "reconnecting in" in page.locator(connection).inner_text()

    # stay unreachable through two retries and at least five samples
    deadline = time.monotonic() + 120
    while len(refused) < 2 or _server_sample_count(hub) < at_drop + 5:
        assert time.monotonic() < deadline, (len(refused), at_drop)
        page.wait_for_timeout(250)
    reachable["now"] = True
    page.wait_for_selector(f"{connection}[data-state=open]", timeout=60_000)

    # the samples of the outage came back with the backfill: the chart has what the server has,
    # give or take the sample or two in flight between the two reads (without the backfill it
    # would stay short by the whole outage, five samples or more)
    deadline = time.monotonic() + 30
    while True:
        points, held = _points(page), _server_sample_count(hub)
        if held - points <= 2:
            break
        assert time.monotonic() < deadline, f"the chart has {points} samples, the server {held}"
        page.wait_for_timeout(250)
    assert len(connections) == 2


@pytest.mark.skipif(_extension_installed() is not None, reason=_extension_installed() or "")
def test_monitor_without_a_gpu_source_says_so_in_the_panel_and_the_status_bar(
    make_hub, page, tmp_path
):
    _spawn_lab(make_hub, tmp_path, page, source="none")
    page.wait_for_function(
        "sel => document.querySelector(sel)?.textContent === 'GPU: none'", arg=STATUS
    )
    _open_monitor_from_palette(page)
    panel = page.locator(MONITOR)
    message = panel.locator("[data-testid=gpulab-source-message]")
    assert "GPU monitoring is off" in message.inner_text()
    assert panel.locator("[data-testid=gpulab-share-source]").inner_text() == "none"
    assert panel.locator("[data-testid=gpulab-device]").count() == 0
    assert panel.locator("[data-testid=gpulab-simulated-badge]").count() == 0
    page.screenshot(path=str(ARTIFACTS / "gpu-monitor-none.png"))


@pytest.mark.skipif(_extension_installed() is not None, reason=_extension_installed() or "")
def test_refresh_rate_setting_is_the_rate_the_panel_asks_the_server_for(make_hub, page, tmp_path):
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    hub, _ = _spawn_lab(make_hub, tmp_path, page)
    # what the Settings Editor saves, through JupyterLab's settings API
    r = httpx.put(
        f"{hub.url}/user/admin/lab/api/settings/jupyterlab-gpulab:monitor",
        json={"raw": json.dumps({"refreshRateHz": 0.5})},
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )
    assert r.status_code == 204, r.text
    page.reload()
    page.wait_for_selector(".jp-LabShell", timeout=60_000)
    _open_monitor_from_palette(page)
    connection = page.locator(f"{MONITOR} [data-testid=gpulab-connection][data-state=open]")
    connection.wait_for()
    assert connection.inner_text() == "live · 0.5 Hz"
    monitor_sockets = [u for u in sockets if "/gpulab/monitor/ws" in u]
    assert monitor_sockets and monitor_sockets[-1].endswith("?rate_hz=0.5"), monitor_sockets
