"""Dask clusters: stock clusters beside gpulab's hub-owned ones, in the same run (issue 17's
measurement contract).

- local anchor: `distributed.LocalCluster(processes=True)` as it ships, in this process (its
  scheduler in-process, each worker a process of its own under a nanny);
- local gpulab: a real hub on the embedded default (the shipped config, `GPUSimpleLocalSpawner`,
  simulated GPUs: a declared inventory of two A100s and a quota of both), clusters through
  `/hub/api/gpulab/users/{user}/dask-clusters` with the user's own token, as
  `gpulab.dask.GPUCluster` does: POST the spec, fetch `credentials` once the scheduler runs and
  connect a `distributed.Client` over the cluster's mutual TLS; workers on a 1/4-GPU profile,
  processes of the user's account;
- Kubernetes anchor: stock dask-kubernetes `KubeCluster` (the operator's `DaskCluster`) on a
  private dev cluster (`gpulab.devcluster`: real control plane, pods run as processes by the
  node agent; one node of two A100s time-sliced four ways), with the operator as gpulab runs it
  (`tests.harness.dask_kube`). Its spec is `make_cluster_spec`'s with this Python as the
  containers' command and one `nvidia.com/gpu.shared` per worker; its scheduler Service is a
  NodePort, since this host cannot resolve a Service's name (KubeCluster would then
  port-forward through the API server);
- Kubernetes gpulab: a hub with `GPUKubeSpawner` on that dev cluster (time-slicing, a 1/4-GPU
  profile), clusters through the same REST calls.

A side that cannot run (its warm-up fails, or this checkout lacks it) is a row saying why, and
its backend's ratio is n/a. Known: the stock KubeCluster failed on the dev cluster's former
Kubernetes 1.20.2 (kr8s builds kinds from discovery's `singularName`, empty before 1.27; kr8s
PR #651); on 1.37 it starts. Its operator, on this host as gpulab runs it, retires workers by
asking the scheduler at its Service's name, which this host cannot resolve (it tries for about
10 s), then through a port-forward of the API server to the scheduler's pod (the node agent's
kubelet API serves it since 2026-12-07): the stock side's scale N->0 includes both, as it would
for an operator run outside any real cluster.

Per backend, rounds alternate anchor and gpulab (order flipped every round; one untimed warm-up
each). A round on one side: cluster-up (from the call that asks for a cluster of N workers to a
client connected to its scheduler seeing N workers), scale to 0 (untimed, until the scheduler
has no worker), then scale 0->N (the scale call to N workers seen) and N->0 (the scale call to
none seen), then shutdown. Both sides are timed the same way: the client's clock around their
own calls, readiness polled every `POLL_SECONDS` through a `distributed.Client` on the
scheduler. Before 0->N, gpulab's side also waits (untimed) until no retired worker holds its
share any more, so that both start from nothing. Leaked: after the last shutdown of a backend (at least `--leak-wait` seconds, 60 by
the contract, after it), the worker and scheduler processes still alive (local: the pids each
scheduler reported, and on gpulab's side every process of the user's account running dask) or
pods of the clusters still present (Kubernetes: pods labelled `dask.org/cluster-name`).

    .venv/bin/python -m bench.dask [--quick] [--workers 4] [--rounds 10] [--leak-wait 60]
                                   [--no-kube] [--no-local]                      (as root)

Last line: local_up_ratio=<gpulab p50 / anchor p50, cluster-up> kube_up_ratio=<same or n/a>
leaked=<n, both backends, both sides>, the line before it saying why a ratio is n/a. Targets:
both ratios <= 1.2, leaked 0. --quick (alias --small): 2 workers, 2 rounds per side.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from traitlets.config import Config

from bench._lastline import NA, print_last_lines
from bench.dask_kube import kube_unavailable, run_kube
from bench.dask_measure import WIDTH, Backend, measure, print_backend
from bench.dask_sides import USER, GpulabClusters, GpulabLocal, LocalAnchor

PROFILE = "gpu-quarter"
#: simulated GPUs, as the Dask tests use, and a quota of both: the default one (1 GPU) would
#: refuse a scale to N=4 quarter workers while the shares of workers just retired are still held
#: (each keeps its share until its process is gone); everything else is the shipped default
GPULAB_OVERLAY = Config(
    GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB", "default_user_quota_gpus": 2}
)


# -- the runs ------------------------------------------------------------------------------------


@contextmanager
def local_backend(root: Path, gpulab: bool) -> Iterator[Backend]:
    """The local backend's sides (gpulab's through a hub of its own), torn down after."""
    backend = Backend("local")
    backend.sides.append(LocalAnchor())
    if not gpulab:
        yield backend
        return
    from tests.harness.hub import Hub
    from tests.harness.jobs import user_client

    hub = Hub(root / "gpulab", GPULAB_OVERLAY)
    try:
        hub.start()
        hub.create_user(USER)
        hub.start_server(USER, profile="cpu")  # makes her account and home
        hub.stop_server(USER)  # clusters need no server (keep_alive is not needed either)
        token = user_client(hub, USER).headers["Authorization"].removeprefix("token ")
        creds = root / "credentials"
        creds.mkdir(mode=0o700)
        api = GpulabClusters(hub.url, token, USER, creds, PROFILE)
        backend.sides.append(GpulabLocal(api, hub.account(USER).pw_uid))
        yield backend
    except BaseException:
        print(hub.log()[-3000:], file=sys.stderr)
        raise
    finally:
        hub.close()
        hub.cleanup()


def gpulab_local_unavailable() -> str | None:
    """Why gpulab's local side cannot run in this checkout, or None when it can."""
    try:
        from gpulab.hub.daskservice.executor import RunsDaskClusters
        from gpulab.hub.daskservice.hub import GPUDask  # noqa: F401
        from gpulab.spawner.local.spawner import GPUSimpleLocalSpawner
    except ImportError as e:
        return f"no hub Dask service in this checkout ({e.name})"
    if not isinstance(GPUSimpleLocalSpawner, RunsDaskClusters):
        return "the local backend runs no Dask clusters yet (GPUSimpleLocalSpawner.dask_executor)"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        "--small",  # its first name, kept for scripts that use it
        dest="quick",
        action="store_true",
        help="2 workers, 2 rounds per side (a few minutes)",
    )
    parser.add_argument("--workers", type=int, default=None, help="N, workers per cluster (4)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per side (10)")
    parser.add_argument(
        "--leak-wait", type=float, default=None, help="seconds after shutdown to look (60)"
    )
    parser.add_argument("--no-kube", action="store_true", help="skip the Kubernetes backend")
    parser.add_argument("--no-local", action="store_true", help="skip the local backend")
    parser.add_argument(
        "--no-kube-anchor", action="store_true", help="Kubernetes: gpulab's side only (no ratio)"
    )
    return parser.parse_args(argv)


def sizes(args: argparse.Namespace) -> tuple[int, int, float]:
    """Workers per cluster, timed rounds per side, seconds to wait before looking for leaks:
    what was asked, else the quick run's or the full run's."""
    n = args.workers if args.workers is not None else (2 if args.quick else 4)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 10)
    leak_wait = args.leak_wait if args.leak_wait is not None else 60.0
    return n, rounds, leak_wait


def why_no_ratio(backend: Backend) -> str:
    """Why `backend` has no cluster-up ratio (its note, else the sides not measured)."""
    if backend.note:
        return backend.note
    if backend.missing:
        return "; ".join(f"{side} not measured: {why}" for side, why in backend.missing.items())
    return "no timed round"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n, rounds, leak_wait = sizes(args)
    if os.geteuid() != 0:
        print("bench.dask: gpulab runs clusters as each user's own account; run it as root")
        return 2

    load0 = os.getloadavg()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-dask-") as tmp:
        root = Path(tmp)
        why_not_local = gpulab_local_unavailable()
        if args.no_local:
            local = Backend("local", note="--no-local")
        else:
            with local_backend(root, gpulab=why_not_local is None) as local:
                if why_not_local is not None:
                    local.missing["gpulab"] = why_not_local
                # without gpulab's side, the anchor alone: its numbers are there, gpulab's rows
                # say why not
                with main_module_as_in_a_notebook():
                    measure(local, n, rounds, leak_wait)
        why_not_kube = "--no-kube" if args.no_kube else kube_unavailable()
        if why_not_kube is None:
            kube = run_kube(root, n, rounds, leak_wait, anchor=not args.no_kube_anchor)
        else:
            kube = Backend("kube", note=why_not_kube)

    print(f"{'measure':<{WIDTH}} {'n':>4} {'p50 s':>8} {'p95 s':>8} {'max s':>8}  note")
    local_ratio = print_backend(local, n)
    kube_ratio = print_backend(kube, n)
    leaked = sum(count for b in (local, kube) for count, _ in b.leaked.values())
    load1 = os.getloadavg()
    print(
        f"{n} workers per cluster, {rounds} timed rounds per side, leaks looked for "
        f"{leak_wait:.0f} s after the last shutdown; {os.cpu_count()} CPUs; 1-min load "
        f"{load0[0]:.2f} at the start, {load1[0]:.2f} at the end; "
        f"{time.monotonic() - t_start:.0f} s in all"
    )
    print_last_lines(
        *last_fields({"local": local_ratio, "kube": kube_ratio}, [local, kube], leaked)
    )
    return 0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"


def last_fields(
    ratios: dict[str, float | None], backends: list[Backend], leaked: int
) -> tuple[dict[str, str | None], dict[str, str]]:
    """The last line's fields (a ratio None or NaN: not measured) and why each is not."""
    by_title = {b.title: b for b in backends}
    fields: dict[str, str | None] = {}
    why_not: dict[str, str] = {}
    for title, ratio in ratios.items():
        name = f"{title}_up_ratio"
        fields[name] = None if _fmt(ratio) == NA else _fmt(ratio)
        if fields[name] is None:
            why_not[name] = f"{title}: {why_no_ratio(by_title[title])}"
    fields["leaked"] = str(leaked)
    return fields, why_not


@contextmanager
def main_module_as_in_a_notebook() -> Iterator[None]:
    """The stock LocalCluster's workers are spawned, and a spawned process imports its parent's
    ``__main__`` again. In a notebook that is the kernel's, which has no file: they import
    nothing. Run as ``python -m bench.dask`` it would be this bench (0.3 s of imports per
    worker, which would slow the anchor down): while the local backend is measured, a bare
    module stands in for it, as in a notebook (this module's functions keep their own globals;
    nothing of it is pickled to workers)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


if __name__ == "__main__":
    raise SystemExit(main())
