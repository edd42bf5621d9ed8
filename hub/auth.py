"""The embedded default's authenticator: NativeAuthenticator with an admin created on first run.

No password is ever hard-coded: on the first start a random one is generated for the initial admin
and written to a file only the hub's account can read; the admin changes it after logging in
(/hub/change-password) and approves users who sign up (/hub/authorize).

Login hardening uses NativeAuthenticator's own options (minimum password length, the
common-password list, lockout after failed logins; set in the shipped config). On top of them:
approving, unapproving and discarding a user are POSTs with JupyterHub's XSRF token (a link in a
mail cannot approve anyone), and the login page says when an account waits for approval or is
locked instead of "Invalid username or password".
"""

from __future__ import annotations

import asyncio
import os
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import ChoiceLoader, FileSystemLoader
from jupyterhub.handlers.login import LoginHandler as HubLoginHandler
from jupyterhub.scopes import needs_scope
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator.handlers import TEMPLATE_DIR as NATIVE_TEMPLATES
from nativeauthenticator.handlers import LocalBase
from nativeauthenticator.handlers import LoginHandler as NativeLoginHandler
from nativeauthenticator.orm import UserInfo
from tornado import web
from tornado.escape import url_escape
from tornado.httputil import url_concat
from traitlets import Unicode, default

from gpulab.hub.config import GPULabHubHooks
from gpulab.hub.refusals import shown


class GPULabLoginHandler(NativeLoginHandler):
    """NativeAuthenticator's login page with JupyterHub 6's login flow: its own POST handler uses
    the removed `statsd` attribute, and JupyterHub now passes extra template arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # NativeAuthenticator adds its templates to the async environment only; the error path
        # below renders with the sync one
        env = self.settings["jinja2_env_sync"]
        if not getattr(env, "gpulab_native_templates", False):
            env.loader = ChoiceLoader([env.loader, FileSystemLoader([NATIVE_TEMPLATES])])
            env.gpulab_native_templates = True

    def _render(
        self,
        login_error: str | None = None,
        username: str | None = None,
        sync: bool = False,
        **_: Any,
    ) -> Any:
        if sync:
            # JupyterHub's error path (an expired or missing XSRF token) renders the login page
            # from write_error, which cannot await: the page is rendered there and then
            return self.render_template(
                "native-login.html", sync=True, **self._login_namespace(login_error, username)
            )
        return self._render_async(login_error, username)

    async def _render_async(self, login_error: str | None, username: str | None) -> Any:
        if login_error and self.request.method == "POST":
            login_error = await self._why_refused() or login_error
        return await self.render_template(
            "native-login.html", **self._login_namespace(login_error, username)
        )

    def _login_namespace(self, login_error: str | None, username: str | None) -> dict[str, Any]:
        """What NativeAuthenticator's login template expects (as its own _render passes it)."""
        authenticator = self.authenticator
        return {
            "next": url_escape(self.get_argument("next", default="")),
            "username": username,
            "login_error": login_error,
            "custom_html": authenticator.custom_html,
            "login_url": self.settings["login_url"],
            "enable_signup": authenticator.enable_signup,
            "two_factor_auth": authenticator.allow_2fa,
            "authenticator_login_url": url_concat(
                authenticator.login_url(self.hub.base_url),
                {"next": self.get_argument("next", "")},
            ),
        }

    async def _why_refused(self) -> str | None:
        """A refused login with the right password: waiting for approval, or locked out."""
        authenticator = self.authenticator
        username = authenticator.normalize_username(self.get_body_argument("username", "").strip())
        password = self.get_body_argument("password", "", strip=False)
        info = authenticator.get_user(username)
        if info is None:
            return None
        if authenticator.allowed_failed_logins and authenticator.is_blocked(username):
            attempt = authenticator.login_attempts[username]
            elapsed = (datetime.now() - attempt["time"]).total_seconds()
            wait = max(1, int(authenticator.seconds_before_next_try - elapsed) + 1)
            return f"Too many failed logins for {shown(username)}: try again in {wait} seconds."
        # bcrypt takes a tenth of a second: off the event loop
        if not info.is_authorized and await asyncio.to_thread(info.is_valid_password, password):
            return (
                f"Your account {shown(username)} is waiting for an admin's approval; "
                "you can log in once an admin has approved it."
            )
        return None

    post = HubLoginHandler.post


class _AuthorizationBase(LocalBase):
    """The approval pages: changes only by POST with JupyterHub's XSRF token, admins only."""

    def _user_info(self, username: str) -> Any:
        info = self.authenticator.get_user(username)
        if info is None:
            raise web.HTTPError(404, f"No signed-up user {shown(username)}")
        return info

    def _back(self, username: str = "") -> None:
        self.redirect(self.hub.base_url + "authorize" + (f"#{username}" if username else ""))


class AuthorizationAreaHandler(_AuthorizationBase):
    """GET /hub/authorize: every signed-up user with Approve / Unapprove / Discard buttons."""

    @needs_scope("admin:users")
    async def get(self) -> None:
        # hub/templates is on JupyterHub's template path (gpulab.hub.config.apply)
        page = await self.render_template(
            "gpulab-authorize.html",
            ask_email=self.authenticator.ask_email_on_signup,
            users=self.db.query(UserInfo).order_by(UserInfo.username).all(),
        )
        self.finish(page)


class ApproveUserHandler(_AuthorizationBase):
    """POST /hub/authorize/{user} with action=approve|unapprove (not a toggle: a replayed
    request does not undo itself). A GET changes nothing."""

    @needs_scope("admin:users")
    async def get(self, username: str) -> None:
        raise web.HTTPError(
            405, "Approving a user takes the Approve button on /hub/authorize (a POST), not a link"
        )

    @needs_scope("admin:users")
    async def post(self, username: str) -> None:
        info = self._user_info(username)
        action = self.get_body_argument("action", "")
        if action not in ("approve", "unapprove"):
            raise web.HTTPError(400, f"Unknown action {shown(action)}: approve or unapprove")
        info.is_authorized = action == "approve"
        self.db.commit()
        self.log.info("%s %sd user %s", self.current_user.name, action, username)
        self._back(username)


class DiscardUserHandler(_AuthorizationBase):
    """POST /hub/discard/{user}: forget a user who signed up and was never approved."""

    @needs_scope("admin:users")
    async def get(self, username: str) -> None:
        raise web.HTTPError(
            405, "Discarding a user takes the Discard button on /hub/authorize (a POST), not a link"
        )

    @needs_scope("admin:users")
    async def post(self, username: str) -> None:
        info = self._user_info(username)
        if info.is_authorized:
            raise web.HTTPError(409, f"{shown(username)} is approved: unapprove them first")
        self.authenticator.delete_user(type("User", (), {"name": username}))
        if self.users.get(username) is not None:
            self.users.delete(username)
        self._back()


_REPLACED = {
    r"/login": GPULabLoginHandler,
    r"/authorize": AuthorizationAreaHandler,
    r"/authorize/([^/]*)": ApproveUserHandler,
    r"/discard/([^/]*)": DiscardUserHandler,
}


class GPULabAuthenticator(GPULabHubHooks, NativeAuthenticator):
    initial_admin = Unicode(
        "admin",
        config=True,
        help="""User name of the admin created on first run (added to Authenticator.admin_users).
        Empty: create none.""",
    )
    initial_admin_password_file = Unicode(
        config=True,
        help="""Where the generated password of the initial admin is written (mode 0600) on first
        run. Delete the file once you have changed the password.""",
    )

    @default("initial_admin_password_file")
    def _default_password_file(self) -> str:
        return os.path.abspath("initial-admin-password")

    @default("admin_users")
    def _default_admin_users(self) -> set[str]:
        return {self.initial_admin} if self.initial_admin else set()

    def __init__(self, **kwargs: Any) -> None:
        # GPULabHubHooks: quiet refusals and the GPU configuration check at hub start
        super().__init__(**kwargs)
        self.ensure_initial_admin()

    def ensure_initial_admin(self) -> None:
        if not self.initial_admin or self.user_exists(self.initial_admin):
            return
        password = secrets.token_urlsafe(18)
        path = Path(self.initial_admin_password_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        self.admin_users.add(self.initial_admin)
        created = self.create_user(self.initial_admin, password)
        if created is None:
            raise RuntimeError(f"could not create the initial admin {self.initial_admin!r}")
        created.is_authorized = True
        self.db.commit()
        self.log.warning(
            "Created admin user %r; its password is in %s (readable by this account only). "
            "Log in at /hub/login and change it at /hub/change-password.",
            self.initial_admin,
            path,
        )

    def get_handlers(self, app: Any) -> list[Any]:
        # GPULabHubHooks puts gpulab's server checks first; gpulab's own REST endpoints and pages
        # are registered by gpulab.hub.config.apply, for every authenticator alike
        return [
            (route, _REPLACED.get(route, handler)) for route, handler in super().get_handlers(app)
        ]
