"""The hub page that hands VS Code (or another IDE) a scoped, expiring token: /hub/gpulab/ide.

VS Code's JupyterHub extension (microsoft/vscode-jupyter-hub) asks for a user name and a password,
and takes a token typed as the password (its `verifyApiToken`). Without one it would post the
password to `/hub/api/users/{name}/tokens` for an unscoped token that never expires, which a hub
behind single sign-on cannot answer (vscode-jupyter-hub#122). Here a person logged in to the hub
(whatever the authenticator) makes a token that holds only what the extension's requests need on
her own servers (`IDE_TOKEN_SCOPES`) and expires (`GPULab.ide_token_expires_in_seconds`). The
token is shown once; the hub stores only its hash, and no password goes to the IDE.

A plain HTML form posting back to the page with JupyterHub's XSRF token.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from jupyterhub.handlers.base import BaseHandler
from tornado import web

from gpulab.hub.refusals import check_body_size

#: the page's template, in hub/templates
TEMPLATE = "gpulab-ide.html"
#: what the extension's sequence needs on the user's own servers, nothing more: read her server
#: list (`GET /hub/api/users/{name}`, `read:servers` includes `read:users:name`), start and stop
#: them (`servers` = read, start, delete), and reach them (kernels, contents). gpulab's
#: /hub/api/gpulab/capacity needs only an authenticated caller.
IDE_TOKEN_SCOPES = ("access:servers!user", "servers!user")
#: the note the token carries on /hub/token, where the user can revoke it
IDE_TOKEN_NOTE = "VS Code (gpulab)"


def ide_token_expiry_seconds(config: Any) -> int:
    """`GPULab.ide_token_expires_in_seconds` from the hub's config."""
    # imported here: gpulab.hub.config imports this package to register its routes
    from gpulab.hub.config import GPULab

    return int(GPULab(config=config).ide_token_expires_in_seconds)


class IDETokenPageHandler(BaseHandler):
    """GET/POST /hub/gpulab/ide: the steps to connect VS Code, and a button that makes the
    token (shown once)."""

    async def prepare(self) -> None:
        if self.request.method == "POST":
            check_body_size(self)
        await super().prepare()

    def _hub_url(self) -> str:
        """The address the IDE connects to: the hub's public URL, else the one this page was
        reached at."""
        public = self.settings.get("public_url")
        if public:
            return str(public.geturl()).rstrip("/") + "/"
        return f"{self.request.protocol}://{self.request.host}{self.base_url}"

    async def _render(self, seconds: int, token: str = "", expires_at: str = "") -> str:
        page = self.render_template(
            TEMPLATE,
            sync=True,
            hub_url=self._hub_url(),
            token=token,
            expires_at=expires_at,
            lifetime=_lifetime_label(seconds),
            scopes=IDE_TOKEN_SCOPES,
            capacity_url=f"{self.hub.base_url}api/gpulab/capacity",
        )
        return str(page)

    @web.authenticated
    async def get(self) -> None:
        self.write(await self._render(ide_token_expiry_seconds(self.settings["config"])))

    @web.authenticated
    async def post(self) -> None:
        user = self.current_user
        seconds = ide_token_expiry_seconds(self.settings["config"])
        token = user.new_api_token(
            note=IDE_TOKEN_NOTE, scopes=list(IDE_TOKEN_SCOPES), expires_in=seconds
        )
        expires = datetime.now(timezone.utc) + timedelta(seconds=seconds)
        self.log.info(
            "Made a VS Code token for %s (%s), expiring in %d s",
            user.name,
            ", ".join(IDE_TOKEN_SCOPES),
            seconds,
        )
        # never cached: the page carries the token
        self.set_header("Cache-Control", "no-store")
        self.write(
            await self._render(
                seconds, token=token, expires_at=expires.strftime("%Y-%m-%d %H:%M UTC")
            )
        )


def _lifetime_label(seconds: int) -> str:
    if seconds % 86400 == 0:
        days = seconds // 86400
        return f"{days} day{'s' if days != 1 else ''}"
    if seconds % 3600 == 0:
        hours = seconds // 3600
        return f"{hours} hour{'s' if hours != 1 else ''}"
    return f"{seconds} seconds"


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/gpulab/ide", IDETokenPageHandler),
]
