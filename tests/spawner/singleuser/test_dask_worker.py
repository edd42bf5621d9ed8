"""Which worker a gpulab Dask worker process runs (gpulab.spawner.singleuser.dask_worker):
dask-cuda's where it holds a GPU share and dask_cuda is installed, distributed's otherwise, and
its log says which and why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulab.spawner.singleuser.dask_worker import (
    SHARE_PRELOAD,
    START_METHOD_ENV,
    worker_argv,
    worker_process_environment,
)

ARGS = ["tls://10.0.0.1:8786", "--name", "w1"]


def test_a_gpu_share_with_dask_cuda_runs_dask_cuda_within_the_shares_memory() -> None:
    argv, message = worker_argv(
        ARGS,
        holds_gpu=True,
        dask_cuda_installed=True,
        environment={"GPULAB_GPU_MEMORY_LIMIT_MIB": "20480"},
        python="py",
    )
    assert argv == [
        "py",
        "-m",
        "dask",
        "cuda",
        "worker",
        *ARGS,
        "--device-memory-limit",
        "20480MiB",
    ]
    assert message == "gpulab: starting dask-cuda's worker (dask cuda worker) on its GPU share"
    whole, _ = worker_argv(
        ARGS, holds_gpu=True, dask_cuda_installed=True, environment={}, python="py"
    )
    assert whole == ["py", "-m", "dask", "cuda", "worker", *ARGS]


def test_without_dask_cuda_or_without_a_gpu_a_plain_worker_runs_and_says_why() -> None:
    argv, message = worker_argv(
        ARGS, holds_gpu=True, dask_cuda_installed=False, environment={}, python="py"
    )
    assert argv == ["py", "-m", "distributed.cli.dask_worker", *ARGS]
    assert message.endswith("holds a GPU share but dask_cuda is not installed")
    argv, message = worker_argv(
        ARGS, holds_gpu=False, dask_cuda_installed=True, environment={}, python="py"
    )
    assert argv == ["py", "-m", "distributed.cli.dask_worker", *ARGS]
    assert message.endswith("holds no GPU")


def test_with_the_lab_extension_installed_the_worker_preloads_the_share_aware_gpu_figures() -> None:
    argv, _ = worker_argv(
        ARGS,
        holds_gpu=True,
        dask_cuda_installed=True,
        environment={},
        share_preload=True,
        python="py",
    )
    assert argv == ["py", "-m", "dask", "cuda", "worker", *ARGS, "--preload", SHARE_PRELOAD]
    plain, _ = worker_argv(
        ARGS, holds_gpu=False, dask_cuda_installed=False, environment={}, share_preload=True
    )
    assert plain[-2:] == ["--preload", SHARE_PRELOAD]
    # given already (an admin's own arguments): not twice
    again, _ = worker_argv(
        [*ARGS, "--preload", SHARE_PRELOAD],
        holds_gpu=False,
        dask_cuda_installed=False,
        environment={},
        share_preload=True,
    )
    assert again.count(SHARE_PRELOAD) == 1


def test_a_plain_workers_nanny_forks_unless_the_owner_chose_a_method_and_dask_cuda_spawns() -> None:
    assert worker_process_environment({"A": "1"}, dask_cuda=False) == {
        "A": "1",
        START_METHOD_ENV: "fork",
    }
    chosen = {START_METHOD_ENV: "forkserver"}
    assert worker_process_environment(chosen, dask_cuda=False) == chosen
    assert START_METHOD_ENV not in worker_process_environment({}, dask_cuda=True)


def test_a_launched_plain_worker_joins_and_its_nanny_still_kills_it_past_its_memory_limit(
    tmp_path: Path,
) -> None:
    """The real launcher against a real scheduler: the forked worker process joins and runs
    tasks, and the Nanny (the memory share's enforcement) still ends a worker over its limit."""
    import dask
    from distributed import Client, KilledWorker, LocalCluster

    env = {k: v for k, v in os.environ.items() if k != START_METHOD_ENV}
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 0}),
        LocalCluster(
            n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster, timeout=60) as client,
    ):
        log = (tmp_path / "worker.log").open("wb")
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpulab.spawner.singleuser.dask_worker",
                "--",
                cluster.scheduler_address,
                "--name",
                "w0",
                "--nthreads",
                "1",
                "--no-dashboard",
                "--memory-limit",
                "300MiB",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            client.wait_for_workers(1, timeout=120)
            assert client.run(_start_method) == {
                addr: "fork" for addr in client.scheduler_info()["workers"]
            }
            assert client.submit(sum, [1, 2, 3]).result(timeout=60) == 6
            with pytest.raises(KilledWorker):
                client.submit(_hold_memory, 1200 * 2**20, pure=False).result(timeout=120)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
            log.close()


def _start_method() -> str:
    import dask

    return str(dask.config.get("distributed.worker.multiprocessing-method"))


def _hold_memory(size: int) -> int:
    block = b"x" * size  # written, so resident: a zeroed allocation may not be
    time.sleep(30)
    return len(block)
