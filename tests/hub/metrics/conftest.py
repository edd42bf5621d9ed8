"""The `world` fixture of the metrics service's tests: the test's hub
(`tests.harness.metrics_service`) and the service's own web app, each listening on a loopback
port, with the environment a hub gives its service."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tornado import web
from tornado.httpserver import HTTPServer

from gpulab.hub.services.metrics.service import MetricsService
from tests.harness.metrics_service import (
    SERVICE_TOKEN,
    AllocationsHandler,
    Hub,
    UserHandler,
    UsersHandler,
    WhoAmIHandler,
    World,
)
from tests.harness.ports import free_port


@pytest.fixture
async def world(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    hub = Hub()
    hub_app = web.Application(
        [
            (r"/hub/api/user", WhoAmIHandler),
            (r"/hub/api/users", UsersHandler),
            (r"/hub/api/users/([^/]+)", UserHandler),
            (r"/hub/api/gpulab/allocations", AllocationsHandler),
        ],
        hub=hub,
    )
    hub_port, service_port = free_port(), free_port()
    hub_server = HTTPServer(hub_app)
    hub_server.listen(hub_port, "127.0.0.1")
    monkeypatch.setenv("JUPYTERHUB_API_URL", f"http://127.0.0.1:{hub_port}/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", SERVICE_TOKEN)
    monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", f"http://127.0.0.1:{service_port}")
    monkeypatch.delenv("GPULAB_METRICS_CONFIG", raising=False)
    # pushes in a test come faster than any server's period
    service = MetricsService(min_push_interval_seconds=0)
    service.initialize([])
    service_server = HTTPServer(service.make_app())
    service_server.listen(service_port, "127.0.0.1")
    try:
        yield World(hub, service, f"http://127.0.0.1:{service_port}/api/push")
    finally:
        service_server.stop()
        hub_server.stop()
        if service.client is not None:
            service.client.close()
