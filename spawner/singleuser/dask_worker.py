"""Start a gpulab Dask worker: dask-cuda's worker where it holds a GPU share, else distributed's.

`python -m gpulab.spawner.singleuser.dask_worker [--gpu] -- SCHEDULER --name w3 ...` is what a
worker process or pod runs (the hub decides `--gpu`: the worker's placement holds a GPU share).
dask-cuda cannot be installed everywhere (its rapids dependency does not build without a GPU
toolchain), so the choice is made here, at run time, where the worker runs: `dask cuda worker`
when `--gpu` was given and `dask_cuda` is importable, a plain `dask worker` otherwise. Either way
the first line of the worker's log says which and why. A fractional share gives dask-cuda's
worker `--device-memory-limit` (the share's GPULAB_GPU_MEMORY_LIMIT_MIB) so that it spills
within its share rather than at the device's size.

The dashboard's GPU panes read the worker's own GPU figures, which distributed takes from the
whole device: where gpulab's lab extension is installed (every gpulab image; the hub's
environment on the embedded default), the worker preloads `jupyterlab_gpulab.dask_preload`,
which replaces them with the share's (the GPU monitor's share-aware source). Both backends start
workers through this launcher, so neither can forget it.

A plain worker runs in this process (no second Python start); dask-cuda's is exec'd. A plain
worker's Nanny starts its worker process by forking (`START_METHOD_ENV`), not by
distributed's default, spawning: a spawned process starts Python and imports distributed all
over again, which made a worker take twice the start-up CPU and cluster-up time of a
LocalCluster's (bench.dask); a forked one has it imported already. The Nanny stays (it still
restarts the worker and kills it past its `--memory-limit`, the memory share's only
enforcement here). dask-cuda's workers keep spawning: a process that may have touched CUDA
must not fork. A method the owner set herself (the same variable) is left as it is.

Runs as the owner in her image: it imports nothing of the hub's.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence

from gpulab.spawner.names import GPU_MEMORY_LIMIT_MIB_ENV
from gpulab.spawner.singleuser.dask_http import PRELOAD as HTTP_PRELOAD

#: the worker preload that makes the dashboard's GPU figures the share's (see the docstring)
SHARE_PRELOAD = "jupyterlab_gpulab.dask_preload"
#: Dask's variable for how a Nanny starts its worker process (config
#: ``distributed.worker.multiprocessing-method``)
START_METHOD_ENV = "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"


def worker_process_environment(
    environment: Mapping[str, str], *, dask_cuda: bool
) -> dict[str, str]:
    """The worker's environment (pure): a plain worker's Nanny forks its worker process unless
    the owner chose a method herself (see the module's docstring)."""
    env = dict(environment)
    if not dask_cuda:
        env.setdefault(START_METHOD_ENV, "fork")
    return env


def worker_argv(
    args: Sequence[str],
    *,
    holds_gpu: bool,
    dask_cuda_installed: bool,
    environment: Mapping[str, str],
    share_preload: bool = False,
    python: str = sys.executable,
) -> tuple[list[str], str]:
    """The worker's argv and the sentence its log starts with (pure). `share_preload`: the lab
    extension is installed, so the worker loads SHARE_PRELOAD."""
    if share_preload and SHARE_PRELOAD not in args:
        args = [*args, "--preload", SHARE_PRELOAD]
    if holds_gpu and dask_cuda_installed:
        argv = [python, "-m", "dask", "cuda", "worker", *args]
        limit = environment.get(GPU_MEMORY_LIMIT_MIB_ENV, "")
        if limit.isdigit() and "--device-memory-limit" not in args:
            argv += ["--device-memory-limit", f"{limit}MiB"]
        return argv, "gpulab: starting dask-cuda's worker (dask cuda worker) on its GPU share"
    argv = [python, "-m", "distributed.cli.dask_worker", *args]
    why = "holds a GPU share but dask_cuda is not installed" if holds_gpu else "holds no GPU"
    return argv, f"gpulab: starting a plain distributed worker (dask worker): this worker {why}"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    holds_gpu = False
    if args and args[0] == "--gpu":
        holds_gpu, args = True, args[1:]
    if args and args[0] == "--":
        args = args[1:]
    # its HTTP server's /sitemap.json (outside any prefix) answers no one (dask_http)
    args = [*args, "--preload", HTTP_PRELOAD]
    dask_cuda_installed = importlib.util.find_spec("dask_cuda") is not None
    command, message = worker_argv(
        args,
        holds_gpu=holds_gpu,
        dask_cuda_installed=dask_cuda_installed,
        environment=os.environ,
        # the top-level package only: finding a submodule would import the package here
        share_preload=importlib.util.find_spec(SHARE_PRELOAD.split(".")[0]) is not None,
    )
    print(message, flush=True)
    dask_cuda = holds_gpu and dask_cuda_installed  # as worker_argv chose
    env = worker_process_environment(os.environ, dask_cuda=dask_cuda)
    if dask_cuda:
        os.execve(command[0], command, env)
    # a plain worker runs in this process: one Python start, not two
    os.environ.update(env)
    reload_dask_config()
    from distributed.cli.dask_worker import main as dask_worker

    dask_worker.main(args=command[3:], prog_name="dask worker")


def reload_dask_config() -> None:
    """Dask's config read again from the environment and the config paths, as a fresh process
    reads it, where Dask is imported already (a process forked by the fork server: the paths
    include ``DASK_CONFIG``, which differs per cluster); nothing to do where it is not."""
    if "dask.config" not in sys.modules:
        return
    import dask.config

    own = os.environ.get("DASK_CONFIG")
    if own:
        dask.config.PATH = own
        if own not in dask.config.paths:
            dask.config.paths.append(own)
    dask.config.refresh()


if __name__ == "__main__":
    main()
