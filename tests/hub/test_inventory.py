"""GPU inventory: the declared form (no driver here), NVML discovery over the labelled fake
pynvml, and the real NVML path (GPU machines only)."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import Allocator, Inventory, Request
from gpulab.hub.inventory import (
    KNOWN_MODELS,
    InventoryError,
    discover_nvml,
    nvml_available,
    parse_declared,
)
from tests.harness.fake_nvml import a100, installed, mig_instance


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


# -- NVML discovery over the labelled FAKE pynvml (tests/harness/fake_nvml) ---------------------


def _machine() -> dict:
    return {
        "gpus": [
            # two NVLinked A100s, the first in MIG mode with three instances (slots 1, 2 empty)
            a100(
                0,
                nvlink_to=["00000000:08:00.0"],
                mig={
                    "max": 7,
                    "instances": [
                        mig_instance(0, 0, "3g.40gb", 40192),
                        mig_instance(0, 3, "2g.20gb", 19968),
                        mig_instance(0, 5, "1g.10gb", 9856),
                    ],
                },
            ),
            a100(1, nvlink_to=["00000000:07:00.0"]),
            # MIG mode on, no instance configured: nothing to hand out
            a100(2, mig={"max": 7, "instances": []}),
            # a PCIe card: not MIG-capable (NotSupported), no NVLink
            {"uuid": "GPU-t4", "name": "NVIDIA T4", "memory_mib": 15360, "mig_capable": False},
        ]
    }


def test_nvml_discovery_hands_out_mig_instances_never_their_parent():
    with installed(_machine()):
        node = discover_nvml(node_name="fake")
    by_uuid = {g.uuid: g for g in node.gpus}
    parent, empty = a100(0)["uuid"], a100(2)["uuid"]
    assert parent not in by_uuid and empty not in by_uuid
    parts = sorted(
        (g.mig_profile, g.capacity_milli, g.share_step_milli) for g in node.gpus if g.mig_profile
    )
    assert parts == [("1g.10gb", 125, 125), ("2g.20gb", 250, 250), ("3g.40gb", 500, 500)]
    instance = by_uuid["MIG-fa4e0000-0003-4000-8000-000000000000"]
    assert instance.model == "A100-SXM4-80GB" and instance.memory_mib == 19968
    assert node.labels["gpulab.io/mig-enabled"] == f"{parent},{empty}"
    assert by_uuid["GPU-t4"].model == "T4" and not by_uuid["GPU-t4"].mig_capable
    assert by_uuid["GPU-t4"].nvlink_group is None
    # joined by NVLink to the MIG-enabled GPU (whose instances are never in multi-GPU requests)
    assert by_uuid[a100(1)["uuid"]].nvlink_group.startswith("fake/nvlink-")
    # the allocator hands a quarter share the 2g.20gb instance, and never a whole GPU of it
    alloc = Allocator(Inventory([node]), policy="best-fit")
    quarter = alloc.place(Request("ada/", owner="ada", gpu_milli=250))
    assert quarter.gpus[0].uuid == instance.uuid
    assert alloc.capacity(Request("probe", num_gpu=1)) == 2  # the second A100 and the T4


def test_nvml_discovery_without_a_driver_says_why():
    with installed(None):
        ok, why = nvml_available()
    assert not ok and "no NVIDIA driver" in why
