"""The embedded default's authenticator: NativeAuthenticator with an admin created on first run.

No password is ever hard-coded: on the first start a random one is generated for the initial admin
and written to a file only the hub's account can read; the admin changes it after logging in
(/hub/change-password) and approves users who sign up (/hub/authorize).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from jupyterhub.handlers.login import LoginHandler as HubLoginHandler
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator.handlers import LoginHandler as NativeLoginHandler
from traitlets import TraitError, Unicode, default

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.handlers import gpulab_handlers
from gpulab.hub.inventory import InventoryError
from gpulab.hub.profiles import ProfileError


class GPULabLoginHandler(NativeLoginHandler):
    """NativeAuthenticator's login page with JupyterHub 6's login flow: its own POST handler uses
    the removed `statsd` attribute, and JupyterHub now passes extra template arguments."""

    def _render(self, login_error: str | None = None, username: str | None = None, **_: Any) -> Any:
        return NativeLoginHandler._render(self, login_error=login_error, username=username)

    post = HubLoginHandler.post


class GPULabAuthenticator(NativeAuthenticator):
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
        super().__init__(**kwargs)
        self.ensure_initial_admin()
        self.check_gpu_configuration()

    def check_gpu_configuration(self) -> None:
        """Load the GPU inventory, catalog and quotas at hub start, so that a configuration
        mistake stops the hub with a message naming the option instead of failing the first
        spawn."""
        try:
            GPUCapacity.instance(config=self.config, log=self.log)
        except (ProfileError, InventoryError, TraitError, ValueError) as e:
            self.log.critical("gpulab configuration error: %s", e)
            raise SystemExit(1) from None

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
        handlers = [
            (route, GPULabLoginHandler if route == r"/login" else handler)
            for route, handler in super().get_handlers(app)
        ]
        return handlers + gpulab_handlers
