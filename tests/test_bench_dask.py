"""bench.dask: the whole benchmark run small (stock LocalCluster, and gpulab's clusters through a
real hub where this checkout runs them): its table, and a last line in the contract's format with
nothing leaked. No timing is asserted."""

from __future__ import annotations

import contextlib
import io
import math
import os

import pytest

from bench import dask as bench_dask


def test_the_gpulab_local_side_runs_exactly_when_the_local_backend_runs_clusters() -> None:
    why = bench_dask.gpulab_local_unavailable()
    try:
        from gpulab.hub.daskservice.executor import RunsDaskClusters
        from gpulab.spawner.local.spawner import GPUSimpleLocalSpawner
    except ImportError:
        assert why is not None
        return
    assert (why is None) == isinstance(GPUSimpleLocalSpawner, RunsDaskClusters), why


@pytest.mark.slow
@pytest.mark.e2e  # by hand: the benchmark starts its own hub, as outside pytest
@pytest.mark.skipif(os.geteuid() != 0, reason="gpulab runs clusters as users' own accounts: root")
def test_the_benchmark_run_small_prints_its_table_and_the_contracts_last_line() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = bench_dask.main(["--small", "--no-kube", "--leak-wait", "10"])
    text = out.getvalue()
    assert rc == 0, text
    for row in (
        "local: cluster-up to 2 workers, distributed",
        "local: scale 0->2, distributed",
        "local: scale 2->0, distributed",
        "local: leaked after shutdown, distributed",
        "kube: cluster-up",
    ):
        assert row in text, text
    assert "not measured: --no-kube" in text
    last = text.splitlines()[-1]
    fields = dict(item.split("=") for item in last.split())
    assert list(fields) == ["local_up_ratio", "kube_up_ratio", "leaked"], last
    assert fields["kube_up_ratio"] == "n/a", last
    assert fields["leaked"] == "0", text
    if bench_dask.gpulab_local_unavailable() is None:
        assert "local: cluster-up to 2 workers, ratio gpulab/anchor" in text, text
        assert "gpulab: of it, POST to scheduler answering" in text, text
        assert "the run's first (warm-up), gpulab" in text, text
        assert "local: leaked after shutdown, gpulab" in text, text
        ratio = float(fields["local_up_ratio"])
        assert math.isfinite(ratio) and ratio > 0, last
    else:
        assert fields["local_up_ratio"] == "n/a", last
        assert "local: cluster-up to 2 workers, gpulab" in text and "not measured" in text
