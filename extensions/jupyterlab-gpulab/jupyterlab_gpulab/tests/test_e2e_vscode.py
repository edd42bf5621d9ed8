"""VS Code in the browser through a real hub, on a simulated GPU share: code-server opens from
JupyterLab's launcher in Chromium and its terminal has the share's environment; only the
server's owner reaches it; an open, untouched VS Code tab is no activity, typing into it is."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from traitlets.config import Config

from tests.harness.browser import log_in_as_admin, press_until_visible
from tests.harness.wait import wait_for

WORKBENCH = ".monaco-workbench"
TERMINAL = ".terminal-wrapper .xterm"


def _code_server_missing() -> str | None:
    from jupyterlab_gpulab.vscode import find_code_server

    found, why = find_code_server()
    return None if found else why


pytestmark = pytest.mark.skipif(
    _code_server_missing() is not None, reason=_code_server_missing() or ""
)


def _hub(make_hub: Any, **environment: str) -> Any:
    overlay = Config(GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"})
    overlay.Spawner.environment.update(environment)
    return make_hub(overlay)


def _open_terminal(page: Any, attempts: int = 6) -> Any:
    """VS Code's terminal as a person opens it (Ctrl+`), pressed again while none has shown: a
    press that lands while the workbench still moves focus is dropped."""
    terminal = page.locator(TERMINAL).last
    press_until_visible(page, "Control+Backquote", terminal, 10_000, attempts)
    terminal.click()
    return terminal


def _last_activity(hub: Any, user: str) -> datetime:
    stamp = (hub.server_model(user) or {})["last_activity"]
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _culling_state(hub: Any, user: str) -> dict[str, Any]:
    """The server's GPU-aware culling state (its GET records no input)."""
    r = httpx.get(
        f"{hub.url}/user/{user}/gpulab/culling",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_vscode_opens_from_the_launcher_and_its_terminal_sees_the_gpu_share(
    make_hub: Any, page: Any
) -> None:
    hub = _hub(make_hub)
    log_in_as_admin(page, hub)
    page.check("#profile-gpu-quarter")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    card = page.locator(".jp-LauncherCard", has_text="VS Code").first
    card.wait_for(timeout=60_000)
    with page.context.expect_page() as opened:
        card.click()
    vscode = opened.value
    vscode.wait_for_selector(WORKBENCH, timeout=120_000)
    assert vscode.url.startswith(f"{hub.url}/user/admin/vscode/")
    assert "token" not in vscode.url

    _open_terminal(vscode)
    out = "vscode-share.txt"
    vscode.keyboard.type(
        'printf "%s|%s|%s\\n" "$CUDA_VISIBLE_DEVICES" "$GPULAB_GPU_MEMORY_LIMIT_MIB" '
        f'"$GPULAB_PROFILE" > "$HOME/{out}"\n',
        delay=20,
    )
    env = hub.server_env("admin")
    written = Path(env["HOME"]) / out
    wait_for(f"the terminal to write {written}", lambda: written.is_file() or None, 60, 0.5)
    wait_for("the whole line", lambda: written.read_text().endswith("\n") or None, 10, 0.2)
    want = "|".join(env[k] for k in ("CUDA_VISIBLE_DEVICES", "GPULAB_GPU_MEMORY_LIMIT_MIB"))
    assert written.read_text() == f"{want}|gpu-quarter\n"
    assert env["CUDA_VISIBLE_DEVICES"] and int(env["GPULAB_GPU_MEMORY_LIMIT_MIB"]) > 0


def test_only_the_servers_owner_reaches_its_vscode(make_hub: Any) -> None:
    hub = _hub(make_hub)
    for user in ("alice", "bob"):
        hub.create_user(user)
    hub.start_server("alice", profile="gpu-eighth")

    def client(user: str | None) -> httpx.Client:
        headers = {}
        if user is not None:
            r = hub.api("POST", f"/users/{user}/tokens", json={"note": f"{user} vscode"})
            headers["Authorization"] = f"token {r.json()['token']}"
        return httpx.Client(base_url=hub.url, headers=headers, timeout=60)

    # she reaches it: code-server answers (its redirect to her home folder)
    r = client("alice").get("/user/alice/vscode/")
    assert r.status_code == 302 and "folder=" in r.headers["location"], (r.status_code, r.text)
    # bob, logged in with a token of his own, is refused by her server's own auth
    assert client("bob").get("/user/alice/vscode/").status_code == 403
    assert client("bob").get("/user/alice/vscode/stable-x/static/out/x.js").status_code == 403
    # nobody logged in is sent to the hub's login, never to code-server
    r = client(None).get("/user/alice/vscode/")
    assert r.status_code == 302 and "/hub/" in r.headers["location"], r.headers


def test_an_open_vscode_is_activity_only_while_typed_into(make_hub: Any, page: Any) -> None:
    # the server reports its activity to the hub every second (300 s by default); the hub reads
    # the proxy's every 2 s (tests.harness.hub)
    hub = _hub(make_hub, JUPYTERHUB_ACTIVITY_INTERVAL="1")
    log_in_as_admin(page, hub)
    hub.start_server("admin", profile="gpu-quarter")
    page.goto(f"{hub.url}/user/admin/vscode/")
    page.wait_for_selector(WORKBENCH, timeout=120_000)
    time.sleep(8)  # the workbench's start-up has settled and reached the hub
    settled = _last_activity(hub, "admin")
    # open and untouched: its keep-alives and background calls (every second) are no activity
    deadline = time.monotonic() + 25
    while time.monotonic() < deadline:
        assert _last_activity(hub, "admin") == settled, "an untouched VS Code tab was activity"
        time.sleep(1)
    # nor input for GPU-aware culling (nothing else of the server was opened)
    assert _culling_state(hub, "admin")["last_input_seconds_ago"] is None
    _open_terminal(page)
    page.keyboard.type("echo typing\n", delay=50)
    wait_for(
        "typing in VS Code's terminal to reach the hub as activity",
        lambda: _last_activity(hub, "admin") > settled or None,
        30,
        0.5,
    )
    assert _culling_state(hub, "admin")["last_input_seconds_ago"] < 30
