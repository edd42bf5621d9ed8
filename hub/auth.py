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

from gpulab.hub.handlers import gpulab_handlers
from nativeauthenticator import NativeAuthenticator
from traitlets import Unicode, default


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
        return super().get_handlers(app) + gpulab_handlers
