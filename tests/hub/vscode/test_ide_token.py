"""/hub/gpulab/ide: a logged-in user makes a token for VS Code that holds only her own servers
and expires."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from traitlets.config import Config

from gpulab.hub.handlers.ide import IDE_TOKEN_NOTE, IDE_TOKEN_SCOPES
from tests.harness.hub import Hub
from tests.harness.vscode import replay


@pytest.fixture(scope="module")
def hub(make_module_hub) -> Iterator[Hub]:
    hub = make_module_hub(
        Config(
            GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"},
            GPULab={"ide_token_expires_in_seconds": 2 * 86400},
        )
    )
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    yield hub


@pytest.fixture(scope="module")
def made(hub) -> tuple[str, str]:
    """The admin logs in, opens the page and makes a token: (the page, the token)."""
    browser = hub.login("admin", hub.admin_password())
    page = browser.get("/hub/gpulab/ide")
    assert page.status_code == 200, page.text
    assert "gpulab-ide-token" not in page.text  # no token until she asks for one
    r = browser.post("/hub/gpulab/ide", data={"_xsrf": browser.cookies.get("_xsrf", "")})
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    (token,) = re.findall(r'<code class="gpulab-ide-token">([0-9a-f]+)</code>', r.text)
    browser.close()
    return r.text, token


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"token {token}"}


def test_the_page_shows_hub_url_user_token_expiry_and_the_steps(hub, made):
    page, token = made
    assert f'<code class="gpulab-hub-url">{hub.url}/</code>' in page
    assert '<code class="gpulab-user-name">admin</code>' in page
    assert re.search(r'gpulab-ide-expires">\d{4}-\d\d-\d\d \d\d:\d\d UTC<', page)
    assert "expires after 2 days" in page
    assert "Paste the token as the password" in page


def test_the_token_has_exactly_the_ide_scopes_and_an_expiry(hub, made):
    _, token = made
    (model,) = [
        t
        for t in hub.api("GET", "/users/admin/tokens").json()["api_tokens"]
        if t["note"] == IDE_TOKEN_NOTE
    ]
    # JupyterHub stores the scopes expanded, each filtered to her: exactly these, nothing else
    assert sorted(IDE_TOKEN_SCOPES) == ["access:servers!user", "servers!user"]
    assert sorted(model["scopes"]) == [
        "access:servers!user=admin",
        "delete:servers!user=admin",
        "read:servers!user=admin",
        "read:users:groups!user=admin",
        "read:users:name!user=admin",
        "servers!user=admin",
        "start:servers!user=admin",
    ]
    assert model["expires_at"] is not None
    r = hub.client.get("/user", headers=_as(token))
    assert r.status_code == 200, r.text
    assert set(r.json()["scopes"]) >= {"access:servers!user=admin", "start:servers!user=admin"}
    assert not any(s.startswith(("admin", "list:", "tokens")) for s in r.json()["scopes"])


async def test_the_token_starts_and_reaches_her_own_server(hub, made):
    _, token = made

    result = await replay(hub.url, "admin", token)

    assert result.ok, (result.failed_step, result.error)
    assert result.env["GPULAB_PROFILE"] == "cpu"  # the default profile: an empty start


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/hub/api/users"),  # list users
        ("GET", "/hub/api/users/alice"),
        ("POST", "/hub/api/users/alice/server"),  # start another user's server
        ("DELETE", "/hub/api/users/alice/server"),
        ("POST", "/hub/api/users/bob"),  # admin API: create a user
        ("POST", "/hub/api/users/admin/tokens"),  # a new token, unscoped
        ("GET", "/hub/api/gpulab/allocations"),  # gpulab's admin API
        ("GET", "/user/alice/api/status"),  # another user's server
    ],
)
def test_the_token_cannot_reach_others_or_admin_apis(hub, made, method, path):
    _, token = made

    r = httpx.request(method, hub.url + path, headers=_as(token))

    assert r.status_code in (403, 404), (r.status_code, r.text)
    assert hub.server_model("alice") is not None  # her server still runs


def test_the_page_without_login_redirects_to_the_login(hub):
    r = httpx.get(f"{hub.url}/hub/gpulab/ide")

    assert r.status_code == 302
    assert "/hub/login" in r.headers["location"]


def test_a_post_without_the_xsrf_token_is_refused(hub):
    browser = hub.login("admin", hub.admin_password())
    before = len(hub.api("GET", "/users/admin/tokens").json()["api_tokens"])

    r = browser.post("/hub/gpulab/ide", data={})

    assert r.status_code == 403, r.text
    assert len(hub.api("GET", "/users/admin/tokens").json()["api_tokens"]) == before
    browser.close()
