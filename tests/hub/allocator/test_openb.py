"""The openb trace loader and the benchmark's sampling method, on the trace the repository carries
(bench/data/openb, gzip csv; $GPULAB_OPENB_DIR overrides it)."""

from __future__ import annotations

import pytest

import bench._openb as bench_openb
from gpulab.hub.allocator import Allocator, Inventory
from gpulab.hub.allocator.openb import load_openb_pods


def test_openb_inventory_has_the_published_size():
    inv = Inventory.from_openb_csv(bench_openb.node_csv())
    assert len(inv) == 1213
    assert inv.total_gpus == 6212
    assert "V100M32" in inv.models


def test_sampling_reaches_the_target_demand_and_replays_through_the_allocator():
    inv = Inventory.from_openb_csv(bench_openb.node_csv())
    pods = load_openb_pods(bench_openb.trace_file("openb_pod_list_default.csv"))
    seq = bench_openb.sample_pods(pods, inv.total_gpu_milli, seed=42)
    total = sum(p.total_gpu_milli for p in seq)
    assert 1.29 * inv.total_gpu_milli <= total <= 1.3 * inv.total_gpu_milli
    assert seq[:50] != pods[:50]  # shuffled
    alloc = Allocator(inv, policy="best-fit")
    for i, p in enumerate(seq[:300]):
        alloc.place(p.to_request(f"p{i}"))  # the first pods of an empty cluster all fit
    assert alloc.used_gpu_milli == sum(p.total_gpu_milli for p in seq[:300])


def test_published_anchors_are_read_from_the_csv():
    assert bench_openb.published_mean("default", "fgd") == pytest.approx(95.2, abs=0.1)
    assert bench_openb.published_mean("gpuspec33", "best-fit") == pytest.approx(80.4, abs=0.1)
