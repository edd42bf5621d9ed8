"""Kernel websockets with the token in the URL, as VS Code's Jupyter extension opens them.

JupyterHub 4.1+ (`jupyterhub.services.auth.HubAuth._get_token_url`) takes `?token=` only when the
request says `Sec-Fetch-Mode: websocket`, unless `JUPYTERHUB_ALLOW_TOKEN_IN_URL` lets it through
everywhere. Browsers send that header on every websocket; Node's `ws` (VS Code's remote kernels,
microsoft/vscode-jupyter-hub with `@jupyterlab/services` and `appendToken: true`) does not, so its
`.../api/kernels/<id>/channels?token=...` gets 403 although the same token in a header works.

`WebsocketURLTokenHubOAuth` also takes `?token=` on a real websocket upgrade: a request handled by a
tornado `WebSocketHandler` that carries `Upgrade: websocket`. Every other request keeps JupyterHub's
rule, so a link `/user/alice/lab?token=...` still authenticates nothing (the 4.1 fix against
tokens planted in links, which is about navigation). Why this is safe:

- A browser always sends `Sec-Fetch-Mode: websocket` on a websocket, which JupyterHub already
  accepts; a page cannot make a browser send `Upgrade` on anything else (a forbidden header for
  `fetch`/XHR), so no page gains a way to use a token it planted.
- A client that is not a browser and holds the token could equally send it in the `Authorization`
  header: the URL gives it nothing the token does not already give.
- The token is checked exactly as a header token (the user's own or one with `access:servers` on
  this server); the cookie is never set from it (JupyterHub persists URL tokens only on navigation).

It is installed as the identity provider's `hub_auth` when the server runs under a hub (see
`install`); if it cannot be, the server logs a warning and keeps JupyterHub's stock behaviour.
"""

from __future__ import annotations

import logging
from typing import Any

from jupyterhub.services.auth import HubOAuth
from jupyterhub.singleuser.extension import JupyterHubIdentityProvider
from tornado.websocket import WebSocketHandler
from traitlets import default

log = logging.getLogger(__name__)


def is_websocket_upgrade(handler: Any) -> bool:
    """Whether `handler` is serving a websocket handshake: a WebSocketHandler's request with
    `Upgrade: websocket` (which no web page can set on a request of its own)."""
    upgrade = handler.request.headers.get("Upgrade", "")
    return isinstance(handler, WebSocketHandler) and upgrade.lower() == "websocket"


class WebsocketURLTokenHubOAuth(HubOAuth):  # type: ignore[misc]
    """HubOAuth that also takes `?token=` on a websocket upgrade without `Sec-Fetch-Mode`."""

    def _get_token_url(self, handler: Any) -> str | None:
        token: str | None = super()._get_token_url(handler)
        if token:
            return token
        if is_websocket_upgrade(handler):
            return str(handler.get_argument("token", "")) or None
        return token


class GPULabIdentityProvider(JupyterHubIdentityProvider):  # type: ignore[misc]
    """JupyterHub's identity provider with `WebsocketURLTokenHubOAuth` as its hub_auth."""

    @default("hub_auth")
    def _default_hub_auth(self) -> HubOAuth:
        return WebsocketURLTokenHubOAuth(parent=self)


def install(server_app: Any) -> None:
    """Make the server's identity provider gpulab's wherever it is JupyterHub's (a server under a
    hub), whatever the order extensions are linked in. Called when this extension is linked,
    before the server creates its provider (`init_configurables`). JupyterHub's singleuser
    extension sets the provider class in its config when linked, and every extension app linked
    after any other copies the config onto the server again (`update_config`): so the class is
    upgraded now if already JupyterHub's and each time it is set to JupyterHub's later. `verify`
    checks the outcome once loaded."""

    def upgrade(change: Any) -> None:
        if change["new"] is JupyterHubIdentityProvider:
            server_app.identity_provider_class = GPULabIdentityProvider

    server_app.observe(upgrade, names="identity_provider_class")
    if server_app.identity_provider_class is JupyterHubIdentityProvider:
        server_app.identity_provider_class = GPULabIdentityProvider


def verify(server_app: Any) -> bool:
    """Whether kernel websockets take a URL token here; a warning when the server runs under a
    hub but gpulab's provider could not be installed (then JupyterHub's rule stays)."""
    provider = getattr(server_app, "identity_provider", None)
    if not isinstance(provider, JupyterHubIdentityProvider):
        return False  # not under a hub: the server's own token rules apply
    if isinstance(provider.hub_auth, WebsocketURLTokenHubOAuth):
        return True
    server_app.log.warning(
        "jupyterlab_gpulab: identity provider %s is not gpulab's; kernel websockets with the "
        "token only in the URL (VS Code) need Sec-Fetch-Mode: websocket, as JupyterHub requires",
        type(provider).__name__,
    )
    return False
