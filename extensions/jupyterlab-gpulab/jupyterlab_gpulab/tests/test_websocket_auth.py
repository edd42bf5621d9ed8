"""websocket_auth: gpulab's identity provider replaces JupyterHub's whatever order extensions are
linked in, and only a websocket handler's upgrade request counts as a websocket."""

from __future__ import annotations

from typing import Any

from jupyter_server.auth.identity import PasswordIdentityProvider
from jupyter_server.serverapp import ServerApp
from jupyterhub.singleuser.extension import JupyterHubIdentityProvider
from tornado.httputil import HTTPHeaders, HTTPServerRequest, RequestStartLine
from tornado.web import RequestHandler
from tornado.websocket import WebSocketHandler
from traitlets.config import Config

from jupyterlab_gpulab.websocket_auth import GPULabIdentityProvider, install, is_websocket_upgrade

#: what JupyterHub's singleuser extension passes to the server when it is linked
HUB_CONFIG = Config({"ServerApp": {"identity_provider_class": JupyterHubIdentityProvider}})


def test_gpulab_provider_wins_when_jupyterhub_is_linked_first():
    app = ServerApp()
    app.update_config(HUB_CONFIG)

    install(app)
    app.update_config(Config({"ServerApp": {"port": 0}}))  # another extension linked after

    assert app.identity_provider_class is GPULabIdentityProvider


def test_gpulab_provider_wins_when_jupyterhub_is_linked_after():
    app = ServerApp()

    install(app)
    app.update_config(HUB_CONFIG)

    assert app.identity_provider_class is GPULabIdentityProvider


def test_another_provider_is_left_alone():
    app = ServerApp()
    app.update_config(Config({"ServerApp": {"identity_provider_class": PasswordIdentityProvider}}))

    install(app)

    assert app.identity_provider_class is PasswordIdentityProvider


def _handler(cls: type[Any], headers: dict[str, str]) -> Any:
    handler = cls.__new__(cls)  # no application needed: only .request is read
    handler.request = HTTPServerRequest(
        headers=HTTPHeaders({"Host": "127.0.0.1", **headers}),
        start_line=RequestStartLine("GET", "/", "HTTP/1.1"),
    )
    return handler


def test_only_a_websocket_handlers_upgrade_request_is_a_websocket():
    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade"}

    assert is_websocket_upgrade(_handler(WebSocketHandler, upgrade))
    assert is_websocket_upgrade(_handler(WebSocketHandler, {"Upgrade": "WebSocket"}))
    assert not is_websocket_upgrade(_handler(WebSocketHandler, {}))
    # a page or API handler claiming an upgrade is still a plain request
    assert not is_websocket_upgrade(_handler(RequestHandler, upgrade))
