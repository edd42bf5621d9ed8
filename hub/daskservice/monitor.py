"""The hub's connection to one cluster's scheduler: which workers joined, whether it is idle, its
adaptive target, which workers it would close first, retiring them.

The hub connects as a peer of the cluster's TLS (the one certificate of ``ClusterTLS``) through
``distributed``'s ``rpc`` on the hub's own event loop: every call is a coroutine, nothing blocks
the loop (the one blocking step, loading the certificate into an SSL context, runs in a thread).
It is no ``Client``: it registers with the scheduler as nobody, so the scheduler's clients are
exactly the users' (the idle rule counts them).

``distributed`` is imported when a monitor is made, not with this module: a hub without the
``dask`` extra loads the cluster service's module (and answers 501) without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from dataclasses import dataclass
from typing import Any

from .executor import ClusterTLS


def _scheduler_activity(dask_scheduler: Any) -> dict[str, Any]:
    """Runs inside the scheduler (``run_function``): its tasks not yet done, its clients and its
    workers by name. Sent by value (cloudpickle), so the scheduler needs no gpulab installed."""
    busy = {"waiting", "processing", "queued", "no-worker"}
    tasks = sum(1 for ts in dask_scheduler.tasks.values() if ts.state in busy)
    clients = [c for c in dask_scheduler.clients if c != "fire-and-forget"]
    workers = {str(ws.name): ws.address for ws in dask_scheduler.workers.values()}
    return {"tasks": tasks, "clients": len(clients), "workers": workers}


@dataclass(frozen=True)
class SchedulerView:
    """What the scheduler said: tasks not done, clients connected (the hub is none), and the
    workers connected to it, by name (``w3``) to address."""

    tasks: int
    clients: int
    workers: dict[str, str]


class SchedulerMonitor:
    """One cluster's scheduler, as the hub talks to it (see the module docstring)."""

    def __init__(self, address: str, tls: ClusterTLS, *, timeout: float = 10.0) -> None:
        self.address, self.tls, self.timeout = address, tls, timeout
        self._rpc: Any = None
        self._probe: bytes | None = None

    async def _connection(self) -> Any:
        if self._rpc is None:
            import cloudpickle  # type: ignore[import-untyped]
            from distributed.core import rpc
            from distributed.security import Security

            security = Security(  # type: ignore[no-untyped-call]
                require_encryption=True,
                tls_ca_file=self.tls.cert_pem,
                tls_client_cert=self.tls.cert_pem,
                tls_client_key=self.tls.key_pem,
            )
            # builds an SSL context from the PEM text (a temporary file): off the event loop
            args = await asyncio.to_thread(security.get_connection_args, "client")
            self._rpc = rpc(  # type: ignore[no-untyped-call]
                self.address, connection_args=args, timeout=self.timeout
            )
            # a copy that no module holds: cloudpickle sends it by value, not as an import
            probe = types.FunctionType(
                _scheduler_activity.__code__,
                {"__builtins__": __builtins__, "__name__": "__main__"},
                _scheduler_activity.__name__,
            )
            self._probe = cloudpickle.dumps(probe)
        return self._rpc

    async def view(self) -> SchedulerView:
        """The scheduler's tasks, clients and workers now; raises when it does not answer."""
        connection = await self._connection()
        answer = await asyncio.wait_for(connection.run_function(function=self._probe), self.timeout)
        if answer.get("status") != "OK":
            raise RuntimeError(f"the scheduler's answer: {answer.get('exception', answer)!s:.200}")
        result = answer["result"]
        return SchedulerView(int(result["tasks"]), int(result["clients"]), dict(result["workers"]))

    async def adaptive_target(self) -> int:
        """How many workers the scheduler would like for its work now."""
        connection = await self._connection()
        return int(await asyncio.wait_for(connection.adaptive_target(), self.timeout))

    async def workers_to_close(self, n: int) -> list[str]:
        """The names of the ``n`` workers whose data is cheapest to move, best first."""
        connection = await self._connection()
        names = await asyncio.wait_for(
            connection.workers_to_close(n=n, attribute="name"), self.timeout
        )
        return [str(name) for name in names]

    async def retire(self, names: list[str], timeout: float) -> None:
        """Ask the scheduler to move the data of the workers ``names`` away and let them go."""
        connection = await self._connection()
        await asyncio.wait_for(
            connection.retire_workers(names=names, close_workers=False, remove=True), timeout
        )

    async def close(self) -> None:
        if self._rpc is not None:
            rpc, self._rpc = self._rpc, None
            # bounded: a scheduler that went away mid-comm can leave distributed's close waiting
            # forever (a test's teardown hung so), and a hub stopping must not wait on it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rpc.close_rpc(), self.timeout)
