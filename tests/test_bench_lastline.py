"""The benchmarks' last line (bench._lastline), and the command lines of the benchmarks whose
--quick selects part of the work (bench.isolation, bench.kube_fill): what quick selects, without
running them."""

from __future__ import annotations

import pytest

from bench import isolation as bench_isolation
from bench import kube_fill as bench_kube_fill
from bench import warm as bench_warm
from bench._lastline import last_lines


def test_a_line_of_numbers_is_the_only_line() -> None:
    assert last_lines({"ratio": "1.020", "leaks": "0"}, {}) == ["ratio=1.020 leaks=0"]


def test_each_n_a_has_its_reason_on_the_line_before() -> None:
    lines = last_lines(
        {"local": "0.9", "kube": None, "gpu": None}, {"kube": "--no-kube", "gpu": "no GPU here"}
    )
    assert lines == ["n/a: kube: --no-kube; gpu: no GPU here", "local=0.9 kube=n/a gpu=n/a"]


def test_an_n_a_without_a_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="kube"):
        last_lines({"kube": None}, {})


def test_quick_isolation_attacks_the_local_backend_unless_one_is_named() -> None:
    of = bench_isolation.backends_of
    assert of(bench_isolation.parse_args([])) == ["local", "kube"]
    assert of(bench_isolation.parse_args(["--quick"])) == ["local"]
    assert of(bench_isolation.parse_args(["--quick", "--backend", "both"])) == ["local", "kube"]
    assert of(bench_isolation.parse_args(["--backend", "kube"])) == ["kube"]


def test_quick_kube_fill_fills_the_mig_backend_only() -> None:
    full = bench_kube_fill.backends_of(bench_kube_fill.parse_args([]))
    quick = bench_kube_fill.backends_of(bench_kube_fill.parse_args(["--quick"]))
    assert [b[0] for b in full] == ["mig", "time-slicing", "hami"]
    assert [b[0] for b in quick] == ["mig"]
    assert set(bench_kube_fill.OVERADMIT_FIELD) == {b[0] for b in full}


def test_a_warm_bench_without_the_dev_cluster_gives_the_reason_for_its_n_a() -> None:
    assert bench_warm._why_not_kube("no kube binaries") == {"kube_warm_ratio": "no kube binaries"}
    assert bench_warm._why_not_kube(({}, [])) == {}
