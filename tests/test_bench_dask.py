"""bench.dask: its command line (--quick, and --small its older name), and the whole benchmark
run quick (stock LocalCluster, and gpulab's clusters through a real hub where this checkout runs
them): its table, and a last line in the contract's format with nothing leaked. No timing is
asserted."""

from __future__ import annotations

import contextlib
import io
import math
import os

import pytest

from bench import dask as bench_dask
from bench._lastline import last_lines


def test_quick_selects_two_workers_and_two_rounds_and_small_is_its_alias() -> None:
    assert bench_dask.sizes(bench_dask.parse_args([])) == (4, 10, 60.0)
    assert bench_dask.sizes(bench_dask.parse_args(["--quick"])) == (2, 2, 60.0)
    assert bench_dask.parse_args(["--small"]).quick


def test_a_size_given_wins_over_the_quick_ones() -> None:
    args = bench_dask.parse_args(["--quick", "--workers", "3", "--leak-wait", "10"])
    assert bench_dask.sizes(args) == (3, 2, 10.0)


def test_the_stock_kubeclusters_scheduler_service_is_a_nodeport_reachable_from_this_host() -> None:
    """KubeCluster ignores its own scheduler_service_type beside a custom spec: in the spec a
    ClusterIP Service made it port-forward through the API server, and the run waited for ever."""
    pytest.importorskip("dask_kubernetes", reason="the kube extra is not installed")
    from bench.dask_kube import stock_cluster_spec

    spec = stock_cluster_spec("bench-stock-1", 2)
    assert spec["spec"]["scheduler"]["service"]["type"] == "NodePort"
    assert spec["spec"]["worker"]["replicas"] == 2


def test_a_side_whose_scaling_cannot_run_gets_the_cluster_up_ratio_and_says_why_not_more() -> None:
    from bench.dask_measure import Backend, Times, print_backend

    class Side:
        def __init__(self, name: str, unscalable: str = "") -> None:
            self.name, self.label, self.unscalable = name, f"{name} side", unscalable

    backend = Backend("kube", sides=[Side("anchor", "its operator cannot reach"), Side("gpulab")])
    backend.times["anchor"] = Times(up=[2.0, 4.0], first_up=[5.0])
    backend.times["gpulab"] = Times(up=[1.0, 3.0], scale_up=[1.0], scale_down=[0.1])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ratio = print_backend(backend, 4)
    assert ratio == 2.0 / 3.0
    rows = out.getvalue().splitlines()
    assert [r for r in rows if "scale 0->4, anchor side" in r][0].endswith(
        "not measured: its operator cannot reach"
    )
    assert not [r for r in rows if "scale" in r and "ratio" in r]
    assert [r for r in rows if "scale 0->4, gpulab side" in r][0].split()[-4] == "1"


def test_a_backend_without_a_ratio_says_why() -> None:
    assert bench_dask.why_no_ratio(bench_dask.Backend("kube", note="--no-kube")) == "--no-kube"
    local = bench_dask.Backend("local", missing={"gpulab": "no hub Dask service"})
    assert bench_dask.why_no_ratio(local) == "gpulab not measured: no hub Dask service"


def test_the_last_line_has_a_reason_before_it_for_each_ratio_not_measured() -> None:
    local, kube = bench_dask.Backend("local"), bench_dask.Backend("kube", note="--no-kube")
    fields, why_not = bench_dask.last_fields({"local": 0.8312, "kube": None}, [local, kube], 0)
    assert last_lines(fields, why_not) == [
        "n/a: kube_up_ratio: kube: --no-kube",
        "local_up_ratio=0.831 kube_up_ratio=n/a leaked=0",
    ]
    fields, why_not = bench_dask.last_fields({"local": math.nan, "kube": 1.0}, [local, kube], 2)
    assert fields == {"local_up_ratio": None, "kube_up_ratio": "1.000", "leaked": "2"}
    assert why_not == {"local_up_ratio": "local: no timed round"}


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
def test_the_benchmark_run_quick_prints_its_table_and_the_contracts_last_line() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = bench_dask.main(["--quick", "--no-kube", "--leak-wait", "10"])
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
    assert "kube_up_ratio: kube: --no-kube" in text.splitlines()[-2], text
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
