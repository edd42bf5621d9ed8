"""A person's path: log in, see the picker, start a GPU server from the form, land in JupyterLab."""

from __future__ import annotations

import re

import httpx
import pytest
from traitlets.config import Config

from tests.harness.wait import wait_for


def _wait_ready(hub, user: str, timeout: float = 90) -> None:
    """Unlike hub.wait_ready, a server that has no record yet (the form is still posting) is waited
    for too."""
    wait_for(
        f"{user}'s server to be ready",
        lambda: (hub.server_model(user) or {}).get("ready"),
        timeout,
        0.3,
    )


def test_admin_logs_in_picks_a_fraction_in_the_form_and_lands_in_jupyterlab(make_hub):
    hub = make_hub(Config(GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"}))
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


GOOD_PASSWORD = "correct horse battery staple"


def _try_login(hub, username: str, password: str) -> httpx.Response:
    """One login form submission; the response of the login page (no assertion on success)."""
    session = httpx.Client(base_url=hub.url, timeout=30, follow_redirects=True)
    session.get("/hub/login")
    return session.post(
        "/hub/login",
        data={
            "username": username,
            "password": password,
            "_xsrf": session.cookies.get("_xsrf", ""),
        },
    )


def _sign_up(hub, username: str, password: str) -> httpx.Response:
    visitor = httpx.Client(base_url=hub.url, follow_redirects=True, timeout=30)
    visitor.get("/hub/signup")
    return visitor.post(
        "/hub/signup",
        data={
            "username": username,
            "signup_password": password,
            "signup_password_confirmation": password,
            "_xsrf": visitor.cookies.get("_xsrf", ""),
        },
    )


def _signed_up(admin: httpx.Client) -> dict[str, str]:
    """User name -> 'yes'/'no' (approved) as the /hub/authorize page lists them."""
    page = admin.get("/hub/authorize")
    assert page.status_code == 200, page.text[-2000:]
    return dict(re.findall(r'<tr id="([^"]+)"[^>]*data-approved="(yes|no)"', page.text))


def _approve(admin: httpx.Client, username: str, **data: str) -> httpx.Response:
    form = {"action": "approve", "_xsrf": admin.cookies.get("_xsrf", path="/hub/"), **data}
    return admin.post(f"/hub/authorize/{username}", data=form)


def test_wrong_password_is_refused_and_signup_needs_admin_approval(make_hub):
    hub = make_hub()
    r = _try_login(hub, "admin", "not-the-password")
    assert r.status_code == 403 and "Invalid username or password" in r.text

    assert "has been sent to the admin" in _sign_up(hub, "alice", GOOD_PASSWORD).text
    r = _try_login(hub, "alice", GOOD_PASSWORD)
    assert r.status_code == 403
    assert "Your account &#39;alice&#39; is waiting for an admin&#39;s approval" in r.text
    # the waiting message needs the right password: it tells a guesser nothing more
    r = _try_login(hub, "alice", "wrong password, long enough")
    assert "Invalid username or password" in r.text and "approval" not in r.text

    admin = hub.login("admin", hub.admin_password())
    assert _signed_up(admin)["alice"] == "no"
    r = _approve(admin, "alice")
    assert r.status_code == 200 and "/hub/authorize" in str(r.url)
    assert _signed_up(admin)["alice"] == "yes"
    alice = hub.login("alice", GOOD_PASSWORD)
    assert "1/8 GPU" in alice.get("/hub/spawn").text


def test_approval_is_a_post_with_xsrf_never_a_link(make_hub):
    """A link to /hub/authorize/<user> in a mail or on a web page must not approve anyone when an
    admin follows it; a form posted from another site lacks the admin's XSRF token."""
    hub = make_hub()
    _sign_up(hub, "mallory", GOOD_PASSWORD)
    admin = hub.login("admin", hub.admin_password())

    r = admin.get("/hub/authorize/mallory")
    assert r.status_code == 405
    assert "takes the Approve button on /hub/authorize (a POST)" in r.text
    r = admin.post("/hub/authorize/mallory", data={"action": "approve"})  # no _xsrf
    assert r.status_code == 403
    r = admin.get("/hub/discard/mallory")
    assert r.status_code == 405
    assert _signed_up(admin)["mallory"] == "no"
    assert _try_login(hub, "mallory", GOOD_PASSWORD).status_code == 403

    # another user, logged in with a valid XSRF token of their own, is not an admin
    _sign_up(hub, "eve", GOOD_PASSWORD)
    _approve(admin, "eve")
    eve = hub.login("eve", GOOD_PASSWORD)
    r = eve.post(
        "/hub/authorize/mallory",
        data={"action": "approve", "_xsrf": eve.cookies.get("_xsrf", path="/hub/")},
    )
    assert r.status_code == 403
    assert _signed_up(admin)["mallory"] == "no"

    r = _approve(admin, "mallory", action="toggle")
    assert r.status_code == 400 and "Unknown action &#39;toggle&#39;" in r.text
    assert _approve(admin, "nobody").status_code == 404
    r = admin.post("/hub/discard/mallory", data={"_xsrf": admin.cookies.get("_xsrf", path="/hub/")})
    assert r.status_code == 200
    assert "mallory" not in _signed_up(admin)


@pytest.mark.parametrize(
    "password",
    ["short1!", "1234567890", "qwertyuiop"],
    ids=["under-10-characters", "common-digits", "common-keyboard-row"],
)
def test_weak_passwords_are_refused_at_signup(make_hub, password):
    hub = make_hub()
    r = _sign_up(hub, "weak", password)
    assert r.status_code == 200
    assert "at least 10 characters and is not too common" in r.text
    admin = hub.login("admin", hub.admin_password())
    assert "weak" not in _signed_up(admin)


def test_failed_logins_lock_the_account_and_say_so(make_hub):
    hub = make_hub()
    _sign_up(hub, "alice", GOOD_PASSWORD)
    _sign_up(hub, "bob", GOOD_PASSWORD)
    admin = hub.login("admin", hub.admin_password())
    _approve(admin, "alice")
    _approve(admin, "bob")

    for _ in range(4):
        r = _try_login(hub, "alice", "guess number n, long")
        assert r.status_code == 403 and "Invalid username or password" in r.text
    r = _try_login(hub, "alice", "the fifth guess, long")
    assert r.status_code == 403 and "Too many failed logins for &#39;alice&#39;" in r.text
    # locked: the right password no longer logs in, and the page says why
    r = _try_login(hub, "alice", GOOD_PASSWORD)
    assert r.status_code == 403
    assert re.search(
        r"Too many failed logins for &#39;alice&#39;: try again in \d+ seconds", r.text
    )
    assert "/hub/login" in str(r.url)
    # the lock is alice's only
    hub.login("bob", GOOD_PASSWORD)


def test_session_and_xsrf_cookies_are_samesite_lax(make_hub):
    hub = make_hub()
    session = httpx.Client(base_url=hub.url, timeout=30)
    page = session.get("/hub/login")
    xsrf_cookie = [h for h in page.headers.get_list("set-cookie") if h.startswith("_xsrf=")]
    assert xsrf_cookie and all("SameSite=Lax" in h for h in xsrf_cookie), xsrf_cookie
    r = session.post(
        "/hub/login",
        data={
            "username": "admin",
            "password": hub.admin_password(),
            "_xsrf": session.cookies.get("_xsrf", ""),
        },
    )
    assert r.status_code == 302, r.text[-2000:]
    cookies = r.headers.get_list("set-cookie")
    names = {h.split("=", 1)[0] for h in cookies}
    assert {"jupyterhub-hub-login", "jupyterhub-session-id"} <= names, cookies
    assert all("SameSite=Lax" in h for h in cookies), cookies


def test_a_login_form_without_its_xsrf_token_gets_the_login_page_back(make_hub):
    hub = make_hub()
    before = hub.log_path.stat().st_size
    session = httpx.Client(base_url=hub.url, timeout=30)
    session.get("/hub/login")
    r = session.post("/hub/login", data={"username": "admin", "password": hub.admin_password()})
    assert r.status_code == 403
    assert "Login form invalid or expired. Try again." in r.text
    assert 'name="password"' in r.text  # the login form again, not an error page
    assert "jupyterhub-hub-login" not in r.headers.get("set-cookie", "")
    log = hub.log_path.read_bytes()[before:].decode(errors="replace")
    assert "Traceback" not in log and "Uncaught exception" not in log
