"""A person's path: log in, see the picker, start a GPU server from the form, land in JupyterLab."""

from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.e2e


def _wait_ready(hub, user: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model = hub.server_model(user)
        if model and model.get("ready"):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{user}'s server did not become ready")


def test_admin_logs_in_picks_a_fraction_in_the_form_and_lands_in_jupyterlab(make_hub):
    hub = make_hub("c.GPUCapacity.declared_inventory = '1 x A100-SXM4-80GB'\n")
    password = hub.admin_password()
    assert len(password) >= 20  # generated on first run, never a fixed default
    assert (hub.state_dir / "initial-admin-password").stat().st_mode & 0o077 == 0

    browser = hub.login("admin", password)
    picker = browser.get("/hub/spawn")
    assert picker.status_code == 200
    assert "(1/2 GPU - 2 free)" in picker.text
    assert "declared" in picker.text

    r = browser.post(
        "/hub/spawn",
        data={"profile": "gpu-half", "_xsrf": browser.cookies.get("_xsrf", path="/hub/")},
    )
    assert r.status_code == 200, r.text[-2000:]
    _wait_ready(hub, "admin")
    lab = browser.get("/user/admin/lab")
    assert lab.status_code == 200
    assert "/user/admin/lab" in str(lab.url)
    assert re.search(r"JupyterLab", lab.text)
    assert [g["milli"] for g in hub.allocations()["admin/"]["gpus"]] == [500]


def test_wrong_password_is_refused_and_signup_needs_admin_approval(make_hub):
    hub = make_hub()
    with pytest.raises(AssertionError):
        hub.login("admin", "not-the-password")

    import httpx

    visitor = httpx.Client(base_url=hub.url, follow_redirects=True, timeout=30)
    visitor.get("/hub/signup")
    r = visitor.post(
        "/hub/signup",
        data={
            "username": "alice",
            "signup_password": "correct horse battery staple",
            "signup_password_confirmation": "correct horse battery staple",
            "_xsrf": visitor.cookies.get("_xsrf", ""),
        },
    )
    assert r.status_code == 200
    with pytest.raises(AssertionError):
        hub.login("alice", "correct horse battery staple")  # not approved yet

    admin = hub.login("admin", hub.admin_password())
    assert admin.get("/hub/authorize/alice").status_code == 200
    alice = hub.login("alice", "correct horse battery staple")
    assert "1/8 GPU" in alice.get("/hub/spawn").text
