"""A Dask preload of gpulab's: the HTTP routes distributed serves outside the dashboard's prefix
answer 404, in every scheduler and worker of a gpulab cluster.

Why. A local cluster's dashboard listens on 127.0.0.1, which every local account reaches, and is
hidden under a secret prefix only the hub's proxy is told (spawner/local/dask_listeners.py).
distributed serves two routes outside any prefix: ``/``, the dashboard's redirect to
``<prefix>/status`` (its Location names the prefix), and ``/sitemap.json``, the list of every
route (prefixed ones included). Either would hand another tenant the prefix, and so the owner's
dashboard. A worker's HTTP server has the sitemap too. With them gone nothing answers a request
that does not already name the prefix.

``--preload gpulab.spawner.singleuser.dask_http`` (the scheduler's and the worker's launchers
pass it): distributed runs ``dask_setup`` once the server's HTTP application exists. Runs as the
owner: it imports nothing of the hub's.
"""

from __future__ import annotations

from typing import Any

from tornado import web
from tornado.routing import PathMatches, Rule

#: this module, as a preload's name
PRELOAD = "gpulab.spawner.singleuser.dask_http"
#: the paths distributed answers without the prefix (see the module docstring)
UNPREFIXED = r"/(sitemap\.json)?$"


class NotServed(web.RequestHandler):
    """404 to every method (not an ``ErrorHandler``: distributed's router would then look on)."""

    def prepare(self) -> None:
        raise web.HTTPError(404)


def hide_unprefixed_routes(application: web.Application) -> None:
    """The application's router tries ``UNPREFIXED`` first, before any route distributed added."""
    application.default_router.rules.insert(0, Rule(PathMatches(UNPREFIXED), NotServed))


def dask_setup(server: Any) -> None:
    """distributed's preload hook (a Scheduler or a Worker)."""
    application = getattr(server, "http_application", None)
    if application is not None:
        hide_unprefixed_routes(application)
