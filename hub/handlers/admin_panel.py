"""The GPU admin panel, /hub/gpulab/admin: a React app (hub/adminpanel) over the admin REST API.

The page is JupyterHub's page template with a mount point; the app is one esbuild bundle
(`hub/adminpanel/static/admin-panel.js`, built by `bash .ci/dev setup`, shipped in the wheel)
served from /hub/gpulab/admin/static/. Without the bundle the page says so instead of staying
blank. Who may open it: holders of `custom:gpulab:admin-read` (403 otherwise); the actions it
offers are checked again by the REST API, per workload (gpulab.hub.apihandlers.admin).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from jupyterhub.handlers.base import BaseHandler
from jupyterhub.scopes import needs_scope
from jupyterhub.utils import url_path_join
from tornado import web

from gpulab.hub.scopes import ADMIN_READ

#: the page's template, in hub/templates
TEMPLATE = "gpulab-admin.html"
#: where the built app lives (hub/adminpanel/static, git-ignored; package data of gpulab.hub)
STATIC_DIR = Path(__file__).resolve().parents[1] / "adminpanel" / "static"
BUNDLE = "admin-panel.js"
#: the panel's route and its static files' route, relative to the hub's prefix
PAGE_ROUTE = "gpulab/admin"
STATIC_ROUTE = "gpulab/admin/static/"


@functools.lru_cache(maxsize=4)
def _bundle_version(mtime_ns: int, size: int) -> str:
    """A short hash of the bundle, so browsers cache it until it is rebuilt (keyed by mtime and
    size: a rebuild while the hub runs is picked up)."""
    return hashlib.sha256((STATIC_DIR / BUNDLE).read_bytes()).hexdigest()[:12]


def bundle_version() -> str | None:
    """None when the bundle was never built."""
    try:
        stat = (STATIC_DIR / BUNDLE).stat()
    except FileNotFoundError:
        return None
    return _bundle_version(stat.st_mtime_ns, stat.st_size)


class AdminPanelPageHandler(BaseHandler):
    """GET /hub/gpulab/admin: the panel (custom:gpulab:admin-read)."""

    @web.authenticated
    @needs_scope(ADMIN_READ, "admin:users")
    async def get(self) -> None:
        version = bundle_version()
        bundle_url = None
        if version is not None:
            bundle_url = url_path_join(self.hub.base_url, STATIC_ROUTE, BUNDLE) + f"?v={version}"
        html = await self.render_template(
            TEMPLATE,
            bundle_url=bundle_url,
            api_url=url_path_join(self.hub.base_url, "api/gpulab/admin/"),
        )
        self.finish(html)


class AdminPanelStaticHandler(web.StaticFileHandler):
    """The panel's built files. Not secret (the app reads everything through the REST API, which
    checks scopes), so served without login, like JupyterHub's own static files."""

    # the route carries no arguments (gpulab's routes are (pattern, class) pairs): the folder is
    # this one, whatever is passed
    def initialize(self, *args: Any, **kwargs: Any) -> None:
        super().initialize(path=str(STATIC_DIR))


default_handlers: list[tuple[str, type[Any]]] = [
    (rf"/{PAGE_ROUTE}", AdminPanelPageHandler),
    (rf"/{STATIC_ROUTE}(.*)", AdminPanelStaticHandler),
]
