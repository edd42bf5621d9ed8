"""Kernel websockets through the hub with the token only in the URL, as VS Code's Node websocket
sends it (no Sec-Fetch-Mode); plain requests with ?token= stay unauthenticated."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect
from traitlets.config import Config

from tests.harness.hub import Hub
from tests.harness.vscode import make_ide_token, run_cell


@pytest.fixture(scope="module")
def hub(make_module_hub) -> Iterator[Hub]:
    hub = make_module_hub(Config(GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"}))
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="cpu")
    yield hub


def _kernel(hub: Hub, token: str) -> tuple[str, str]:
    base = f"{hub.url}/user/alice/"
    r = httpx.post(
        f"{base}api/kernels", json={"name": "python3"}, headers={"Authorization": f"token {token}"}
    )
    assert r.status_code == 201, r.text
    return base, r.json()["id"]


async def test_kernel_websocket_takes_the_token_in_the_url_without_sec_fetch_mode(hub):
    token = make_ide_token(hub, "alice")
    base, kernel_id = _kernel(hub, token)

    out = await run_cell(base, kernel_id, token, "print(6 * 7)", token_in="url")

    assert out.strip() == "42"
    assert "kernel websockets take the token in the URL" in hub.log()


@pytest.mark.parametrize("path", ["api/status", "api/contents", "lab"])
def test_a_plain_request_with_the_token_only_in_the_url_is_not_authenticated(hub, path):
    token = make_ide_token(hub, "alice")
    # even claiming a websocket upgrade: the request is no websocket handler's
    for headers in ({}, {"Upgrade": "websocket", "Connection": "Upgrade"}):
        r = httpx.get(f"{hub.url}/user/alice/{path}?token={token}", headers=headers)
        if path == "lab":  # a page: sent to the hub's login, not served
            assert r.status_code == 302, r.text
            assert "/hub/api/oauth2/authorize" in r.headers["location"]
        else:
            assert r.status_code == 403, r.text
    # the same token in the header is accepted: the URL is what is refused
    r = httpx.get(f"{hub.url}/user/alice/api/status", headers={"Authorization": f"token {token}"})
    assert r.status_code == 200, r.text


async def test_another_users_token_in_the_url_is_refused_on_her_kernel(hub):
    base, kernel_id = _kernel(hub, make_ide_token(hub, "alice"))
    bobs = make_ide_token(hub, "bob")
    url = base.replace("http", "ws", 1) + f"api/kernels/{kernel_id}/channels?token={bobs}"

    with pytest.raises(HTTPClientError) as refused:
        await websocket_connect(HTTPRequest(url))

    assert refused.value.code == 403
