"""GPUCapacity in-process: catalog from YAML, quotas in exact GPUs, reconciliation, labels."""

from __future__ import annotations

import pytest
from traitlets.config import Config

from gpulab.hub.allocator import Request
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.profiles import ProfileError


def _capacity(tmp_path, **settings) -> GPUCapacity:
    c = Config()
    c.GPUCapacity.inventory_source = "declared"
    c.GPUCapacity.declared_inventory = "2 x A100-SXM4-80GB"
    c.GPUCapacity.db_url = f"sqlite:///{tmp_path / 'alloc.sqlite'}"
    for key, value in settings.items():
        setattr(c.GPUCapacity, key, value)
    return GPUCapacity(config=c)


def test_catalog_from_yaml_file(tmp_path):
    path = tmp_path / "profiles.yaml"
    path.write_text(
        "profiles:\n"
        "  - {slug: cpu, gpus: 0, default: true}\n"
        "  - {slug: eighth, gpus: 1/8, groups: [students]}\n"
    )
    cap = _capacity(tmp_path, profiles_file=str(path))
    assert [p.slug for p in cap.catalog] == ["cpu", "eighth"]
    assert [p.slug for p in cap.visible_profiles(frozenset({"students"}), False)] == [
        "cpu",
        "eighth",
    ]
    assert [p.slug for p in cap.visible_profiles(frozenset(), False)] == ["cpu"]
    assert cap.inventory_is_declared and "2 x A100-SXM4-80GB" in cap.inventory_label


def test_quotas_in_exact_gpus_and_bad_quota_names_the_option(tmp_path):
    cap = _capacity(tmp_path, user_quota_gpus={"alice": "3/2"}, group_quota_gpus={"lab": 0.5})
    assert cap.allocator.quota_left_milli("alice", frozenset()) == 1500
    assert cap.allocator.quota_left_milli("bob", frozenset({"lab"})) == 500
    assert cap.quota_summary("alice", frozenset()) == "GPU quota: 0 GPUs in use, 1.5 GPUs left"
    cap.allocator.place(Request("alice/", owner="alice", gpu_milli=250))
    assert cap.quota_summary("alice", frozenset()) == "GPU quota: 0.25 GPU in use, 1.25 GPUs left"
    assert cap.quota_summary("carol", frozenset()) is None
    with pytest.raises(ProfileError, match=r"GPUCapacity.user_quota_gpus\['bob'\]: 'many'"):
        _capacity(tmp_path / "x", user_quota_gpus={"bob": "many"})


def test_reconcile_releases_allocations_no_server_owns(tmp_path):
    cap = _capacity(tmp_path)
    cap.allocator.place(Request("alice/", owner="alice", num_gpu=1))
    cap.allocator.place(Request("ghost/", owner="ghost", gpu_milli=250))
    orphans = cap.reconcile({"alice/"})
    assert [p.request.id for p in orphans] == ["ghost/"]
    assert [p.request.id for p in cap.allocator.allocations()] == ["alice/"]
    assert cap.reconcile(set()) == []  # once per hub process


def test_reconcile_keeps_what_another_owner_holds(tmp_path):
    """The job service's runs hold allocations no server has: reconciliation keeps those."""
    cap = _capacity(tmp_path)
    cap.allocator.place(Request("alice/job-7", owner="alice", gpu_milli=250))
    cap.allocator.place(Request("alice/job-8", owner="alice", gpu_milli=250))  # its run ended
    cap.keep_allocations(lambda: {"alice/job-7"})
    orphans = cap.reconcile(set())
    assert [p.request.id for p in orphans] == ["alice/job-8"]
    assert [p.request.id for p in cap.allocator.allocations()] == ["alice/job-7"]


def test_allocations_persist_across_capacity_instances(tmp_path):
    cap = _capacity(tmp_path)
    placed = cap.allocator.place(Request("alice/", owner="alice", num_gpu=1))
    again = _capacity(tmp_path)
    assert again.allocator.get("alice/").gpus == placed.gpus


def test_availability_labels(tmp_path):
    cap = _capacity(tmp_path)
    labels = {p.slug: cap.availability(p).label for p in cap.catalog}
    assert labels["cpu"] == "no GPU"
    assert labels["gpu-eighth"] == "1/8 GPU - 16 free"
    assert labels["gpu-2"] == "2 GPUs - 1 free"
    assert labels["gpu-4"] == "4 GPUs - larger than any machine here"
    with cap.waiting("gpu-2"):
        assert cap.availability(cap.profile("gpu-2")).label == "2 GPUs - 1 free, 1 waiting"


QUOTA_CATALOG = [
    {"slug": "cpu", "gpus": 0, "default": True},
    {"slug": "eighth", "gpus": "1/8"},
    {"slug": "half", "gpus": "1/2"},
    {"slug": "one", "gpus": 1},
    {"slug": "spot-2", "gpus": 2, "priority": "preemptible"},
]


def test_quota_refusal_advice_names_profiles_of_the_catalog(tmp_path):
    cap = _capacity(
        tmp_path,
        profiles=QUOTA_CATALOG,
        default_user_quota_gpus=1,
        allow_preemptible_over_quota=False,
    )
    cap.allocator.place(Request("alice/", owner="alice", gpu_milli=500))
    reason = "User 'alice' asks for 1 GPU but has 0.5 GPU of a 1 GPU budget left."
    from gpulab.hub.capacity_catalog import ALLOCATOR_QUOTA_HINT

    message = cap.quota_refusal(reason + ALLOCATOR_QUOTA_HINT, "alice", frozenset(), False)
    assert message == (
        f"{reason} Stop one of your GPU servers, or pick a profile within the 0.5 GPU left "
        "('half', 'eighth')."
    )
    # preemptible profiles are advised where they may run over quota (the default)
    (tmp_path / "spot").mkdir()
    cap_spot = _capacity(tmp_path / "spot", profiles=QUOTA_CATALOG, default_user_quota_gpus=1)
    assert "a preemptible profile, which may run over quota ('spot-2')" in cap_spot.quota_advice(
        "alice", frozenset(), False
    )


def test_quota_advice_without_gpu_left_points_to_cpu_only(tmp_path):
    catalog = [{"slug": "cpu", "gpus": 0, "default": True}, {"slug": "one", "gpus": 1}]
    cap = _capacity(tmp_path, profiles=catalog, default_user_quota_gpus=1)
    cap.allocator.place(Request("bob/", owner="bob", num_gpu=1))
    assert cap.quota_advice("bob", frozenset(), False) == (
        "Stop one of your GPU servers, or a CPU-only server ('cpu')."
    )
    assert "preemptible" not in cap.quota_advice("bob", frozenset(), False)


def test_over_quota_says_what_a_profile_needs_and_what_is_left(tmp_path):
    cap = _capacity(tmp_path, profiles=QUOTA_CATALOG, default_user_quota_gpus="3/4")
    cap.allocator.place(Request("carol/", owner="carol", gpu_milli=500))
    by_slug = {p.slug: p for p in cap.catalog}
    assert cap.over_quota(by_slug["eighth"], "carol", frozenset()) is None
    assert cap.over_quota(by_slug["spot-2"], "carol", frozenset()) is None  # may run over
    assert cap.over_quota(by_slug["cpu"], "carol", frozenset()) is None
    assert cap.over_quota(by_slug["half"], "carol", frozenset()) == (
        "Needs 0.5 GPU; your GPU quota has 0.25 GPU left"
    )
    (tmp_path / "u").mkdir()
    unlimited = _capacity(tmp_path / "u", profiles=QUOTA_CATALOG)
    assert unlimited.over_quota(by_slug["spot-2"], "carol", frozenset()) is None
