"""A plain process executor for the cluster service's own tests: real `dask scheduler` and
`dask worker` processes with the cluster's real TLS, run as the test's account in a temporary
folder, so that the service's logic (admission, joining, scaling, idle stop, restart recovery)
is tested against real schedulers without the local backend's per-user accounts (those are
`LocalDaskExecutor`'s, tested with it and through a real hub in test_rest.py).

It keeps the `DaskExecutor` contract: starts return once the process exists (the scheduler once
it accepts TLS), `stop` returns when nothing of it runs, handles are plain JSON (pid and start
time), so a second service ("the hub after a restart") finds the processes again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from gpulab.hub.allocator import Placement
from gpulab.hub.dask import Cluster, Worker
from gpulab.hub.daskservice.executor import ClusterTLS, Handle, SchedulerStarted
from tests.harness.ports import free_port


class ProcessExecutor:
    def __init__(self, root: Path) -> None:
        self.root = root
        #: every pid it started (the tests check that none is left)
        self.started: list[int] = []
        self.environments: dict[str, dict[str, str]] = {}
        #: "<cluster id>/<worker name>" -> the GPU report the service handed its start
        self.reports: dict[str, Mapping[str, str] | None] = {}

    def _tls_files(self, cluster: Cluster, tls: ClusterTLS) -> tuple[str, str]:
        folder = self.root / f"cluster-{cluster.id}"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        cert, key = folder / "tls.crt", folder / "tls.key"
        for path, text in ((cert, tls.cert_pem), (key, tls.key_pem)):
            path.touch(mode=0o600)
            path.write_text(text)
        return str(cert), str(key)

    async def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
        with open(log, "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(proc.pid)
        created = psutil.Process(proc.pid).create_time()
        asyncio.ensure_future(proc.wait())  # reaped when it ends
        return {"pid": proc.pid, "created": created, "log": str(log)}

    async def start_scheduler(
        self, cluster: Cluster, placement: Placement, tls: ClusterTLS
    ) -> SchedulerStarted:
        cert, key = self._tls_files(cluster, tls)
        folder = self.root / f"cluster-{cluster.id}"
        port, dashboard = free_port(), free_port()
        argv = [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--protocol",
            "tls",
            "--tls-ca-file",
            cert,
            "--tls-cert",
            cert,
            "--tls-key",
            key,
            "--dashboard-address",
            f"127.0.0.1:{dashboard}",
        ]
        handle = await self._spawn(argv, dict(os.environ), folder / "scheduler.log")
        address = f"tls://127.0.0.1:{port}"
        for _ in range(600):  # it accepts connections once its port is open
            with contextlib.suppress(OSError):
                _r, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            if not await self.running(handle):
                raise RuntimeError(
                    f"the scheduler exited: {Path(handle['log']).read_text()[-500:]}"
                )
            await asyncio.sleep(0.1)
        else:
            await self.stop(handle, 1)
            raise RuntimeError("the scheduler did not open its port in 60 s")
        return SchedulerStarted(handle, address, f"http://127.0.0.1:{dashboard}/")

    async def start_worker(
        self,
        cluster: Cluster,
        worker: Worker,
        placement: Placement,
        scheduler_address: str,
        tls: ClusterTLS,
        report: Mapping[str, str] | None = None,
    ) -> Handle:
        cert, key = self._tls_files(cluster, tls)
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(s.uuid for s in placement.gpus)
        self.environments[f"{cluster.id}/{worker.name}"] = env
        self.reports[f"{cluster.id}/{worker.name}"] = report
        argv = [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            scheduler_address,
            "--name",
            worker.name,
            "--nthreads",
            "1",
            "--no-nanny",
            "--host",
            "127.0.0.1",
            "--tls-ca-file",
            cert,
            "--tls-cert",
            cert,
            "--tls-key",
            key,
            "--no-dashboard",
        ]
        log = self.root / f"cluster-{cluster.id}" / f"{worker.name}.log"
        return await self._spawn(argv, env, log)

    def _process(self, handle: Handle) -> psutil.Process | None:
        try:
            proc = psutil.Process(int(handle["pid"]))
            if abs(proc.create_time() - float(handle["created"])) > 0.01:
                return None  # another process under a reused pid
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    async def stop(self, handle: Handle, grace_seconds: float) -> None:
        proc = self._process(handle)
        if proc is None:
            return
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        while self._process(handle) is not None and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self._process(handle) is not None:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        while self._process(handle) is not None:
            await asyncio.sleep(0.05)

    async def running(self, handle: Handle) -> bool:
        return self._process(handle) is not None

    async def exit_reason(self, handle: Handle) -> str:
        return "" if await self.running(handle) else "the process ended"

    def alive(self) -> list[int]:
        """Pids it started that still run."""
        out = []
        for pid in self.started:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
        return out
