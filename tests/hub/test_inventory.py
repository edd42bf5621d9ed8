"""GPU inventory: the declared form (no driver here) and the real NVML path (GPU machines only)."""

from __future__ import annotations

import pytest

from gpulab.hub.inventory import (
    KNOWN_MODELS,
    InventoryError,
    discover_nvml,
    nvml_available,
    parse_declared,
)


def test_declared_inventory_has_stable_uuids_models_and_nvlink_groups():
    node = parse_declared(
        "8 x A100-SXM4-80GB", node_name="gpu-box", cpu_milli=64000, memory_mib=512000
    )
    again = parse_declared("8 x A100-SXM4-80GB", node_name="gpu-box")
    assert [g.uuid for g in node.gpus] == [g.uuid for g in again.gpus]
    assert len({g.uuid for g in node.gpus}) == 8
    assert all(g.uuid.startswith("GPU-") for g in node.gpus)
    assert {g.model for g in node.gpus} == {"A100-SXM4-80GB"}
    assert {g.memory_mib for g in node.gpus} == {81920}
    assert len({g.nvlink_group for g in node.gpus}) == 1  # SXM: one NVSwitch fabric
    assert node.labels["gpulab.io/inventory"] == "declared"
    assert node.cpu_milli == 64000


def test_declared_mixed_inventory_and_pcie_cards_have_no_nvlink():
    node = parse_declared("2 x A100-SXM4-80GB, 2 x T4", node_name="n")
    assert [g.model for g in node.gpus] == ["A100-SXM4-80GB"] * 2 + ["T4"] * 2
    assert [g.index for g in node.gpus] == [0, 1, 2, 3]
    assert {g.nvlink_group for g in node.gpus if g.model == "T4"} == {None}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("8 x A100-SXM9-1TB", "unknown GPU model 'A100-SXM9-1TB'; known models: "),
        ("eight A100s", "cannot read 'eight A100s'"),
        ("", "declared_inventory is empty"),
        ("500 x T4", "absurd"),
    ],
)
def test_bad_declared_inventory_is_refused_with_the_reason(spec, message):
    with pytest.raises(InventoryError) as e:
        parse_declared(spec, node_name="n")
    assert message in str(e.value)


def test_known_models_include_the_common_datacenter_parts():
    assert {"A100-SXM4-80GB", "H100-80GB-HBM3", "H200", "L4", "T4"} <= set(KNOWN_MODELS)


_NVML_OK, _NVML_WHY = nvml_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _NVML_OK, reason=f"needs an NVIDIA driver and GPU: {_NVML_WHY}")
def test_nvml_discovery_reports_every_gpu_with_uuid_model_and_memory():
    import pynvml

    node = discover_nvml(node_name="this-machine")
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        uuids = []
        for i in range(count):
            u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            uuids.append(u.decode() if isinstance(u, bytes) else u)
    finally:
        pynvml.nvmlShutdown()
    assert [g.uuid for g in node.gpus] == uuids
    assert all(
        g.memory_mib > 1024 and g.model and not g.model.startswith("NVIDIA ") for g in node.gpus
    )
    assert node.labels["gpulab.io/inventory"] == "nvml"


def test_nvml_is_reported_unavailable_with_a_reason_where_there_is_no_driver():
    ok, why = nvml_available()
    assert ok or why  # either a GPU answers, or we are told why not
