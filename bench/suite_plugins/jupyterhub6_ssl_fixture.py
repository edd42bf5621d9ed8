"""Opt-in shim for one upstream harness bug of KubeSpawner 7.1.0's suite under JupyterHub 6
(`python -m bench.kubespawner_suite --shim-ssl-fixture`; never in the default, unmodified run).

The suite's session fixture `ssl_app` is synchronous and calls `JupyterHub().init_internal_ssl()`,
which since JupyterHub 6 makes the hub's HTTP client, and that asks for the running event loop:
"no running event loop", so `test_spawn_internal_ssl` and `test_variable_expansion` error before
they start, with or without a cluster. Here `init_internal_ssl` runs inside a short-lived event
loop when none runs (as an async fixture would have it), and the HTTP client singleton made there
is dropped, so the tests' own loop makes its own. Nothing else of the suite changes: the shim shows
that what those tests check of the cluster (an internal-ssl server reached from a hub pod by its
Service's DNS name, through kube-proxy) works, which the default run cannot get to.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jupyterhub.app import JupyterHub
from jupyterhub.httpclient import JupyterHubHTTPClient

_init_internal_ssl = JupyterHub.init_internal_ssl


def _init_internal_ssl_in_a_loop(self: JupyterHub) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:

        async def in_a_loop() -> Any:
            return _init_internal_ssl(self)

        result = asyncio.run(in_a_loop())
        JupyterHubHTTPClient.clear_instance()  # bound to the loop that just closed
        return result
    return _init_internal_ssl(self)


JupyterHub.init_internal_ssl = _init_internal_ssl_in_a_loop  # type: ignore[method-assign]
