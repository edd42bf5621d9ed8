"""The dask-kubernetes operator on a dev cluster, as gpulab runs it: the CRDs applied with their
`$ref`s resolved against the cluster's own OpenAPI (`gpulab.spawner.kube.dask_operator`), and the
operator's process (`kopf run -m dask_kubernetes.operator.controller --all-namespaces`) with the
cluster's kubeconfig; stopped (SIGTERM, then SIGKILL) when the context ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from gpulab.devcluster import DevCluster
from gpulab.spawner.kube.dask_operator import install_crds, operator_command


def apply_operator_crds(cluster: DevCluster) -> list[str]:
    async def run() -> list[str]:
        api = await cluster.api_client()
        try:
            return await install_crds(api)
        finally:
            await api.close()

    return asyncio.run(run())


@contextlib.contextmanager
def running_dask_operator(cluster: DevCluster, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The CRDs applied and the operator running against `cluster`; its log in `log_path`."""
    apply_operator_crds(cluster)
    env = {**os.environ, **cluster.env()}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            operator_command(), env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while b"Initial authentication has finished" not in log_path.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the dask operator did not start: {log_path.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
