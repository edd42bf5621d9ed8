"""A user's alert rules: saved in their home, refused with a position when invalid, evaluated."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyterlab_gpulab.rules import RuleBook, RuleRejected
from jupyterlab_gpulab.sampler import Sample
from jupyterlab_gpulab.sources import DeviceSample

pytest.importorskip("gpulab.hub.alerts", reason="gpulab's rule language (gpulab.hub.alerts)")

IDLE = 'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU")'
HOT = 'IF gpu_utilization > 90% FOR 2s THEN alert("HOT_GPU", severity="critical")'
GPU = "GPU-11111111-2222-3333-4444-555555555555"


def sample(t: float, utilization: float, uuid: str = GPU) -> Sample:
    return Sample.build(t, {uuid: DeviceSample(utilization, 1000.0, 20000.0)})


def test_a_user_rule_is_kept_in_the_home_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / ".gpulab" / "alert-rules.txt"
    book = RuleBook(path, [IDLE])
    entry = book.add(HOT)
    assert entry.source == "user" and entry.rule.name == "HOT_GPU"
    assert entry.rule.to_text() in path.read_text()
    again = RuleBook(path, [IDLE])
    assert [(r["id"], r["source"], r["name"]) for r in again.to_json()] == [
        (r["id"], r["source"], r["name"]) for r in book.to_json()
    ]
    assert {r["source"] for r in again.to_json()} == {"default", "user"}
    assert again.to_json()[1]["severity"] == "critical"


def test_an_invalid_rule_is_refused_with_its_position_and_nothing_is_saved(tmp_path: Path) -> None:
    path = tmp_path / "alert-rules.txt"
    book = RuleBook(path, [IDLE])
    with pytest.raises(RuleRejected) as e:
        book.add('IF gpu_utilisation > 5% THEN alert("X")')
    assert e.value.line == 1 and e.value.column == 4
    assert "gpu_utilisation" in e.value.message
    assert not path.exists()
    assert [r["source"] for r in book.to_json()] == ["default"]


def test_deleting_a_firing_rule_resolves_its_alert_and_forgets_it(tmp_path: Path) -> None:
    path = tmp_path / "alert-rules.txt"
    book = RuleBook(path, [])
    entry = book.add(HOT)
    assert book.observe(sample(100, 95)) == []
    (fired,) = book.observe(sample(102, 96))
    assert (fired["rule"], fired["state"], fired["device"], fired["severity"]) == (
        "HOT_GPU",
        "firing",
        GPU,
        "critical",
    )
    assert [a["rule"] for a in book.active()] == ["HOT_GPU"]
    (resolved,) = book.delete(entry.id, 103.0)
    assert resolved["state"] == "resolved" and resolved["since"] == 102
    assert book.active() == [] and book.to_json() == []
    assert "HOT_GPU" not in path.read_text()
    assert RuleBook(path, []).to_json() == []


def test_an_alert_resolves_when_its_condition_stops_holding(tmp_path: Path) -> None:
    book = RuleBook(tmp_path / "r.txt", [])
    book.add(HOT)
    events = [
        e for t, u in [(0, 95), (1, 95), (2, 95), (3, 40)] for e in book.observe(sample(t, u))
    ]
    assert [(e["state"], e["t"]) for e in events] == [("firing", 2), ("resolved", 3)]
    assert [e["state"] for e in book.recent] == ["firing", "resolved"]


def test_adding_a_rule_does_not_restart_another_rules_timer(tmp_path: Path) -> None:
    book = RuleBook(tmp_path / "r.txt", [])
    book.add(HOT)
    book.observe(sample(0, 95))
    book.observe(sample(1, 95))
    book.add('IF gpu_memory_used > 99% THEN alert("FULL")')
    assert [e["rule"] for e in book.observe(sample(2, 95))] == ["HOT_GPU"]


def test_default_rules_cannot_be_deleted_and_unknown_ids_are_not_found(tmp_path: Path) -> None:
    book = RuleBook(tmp_path / "r.txt", [IDLE])
    (default,) = book.to_json()
    with pytest.raises(PermissionError):
        book.delete(default["id"], 0)
    with pytest.raises(KeyError):
        book.delete("u-000000000000", 0)


def test_a_broken_rules_file_is_reported_and_the_defaults_still_apply(tmp_path: Path) -> None:
    path = tmp_path / "r.txt"
    path.write_text('IF gpu_utilization > 90% THEN alert("OK")\nIF nonsense\n')
    book = RuleBook(path, [IDLE])
    assert "line 2" in book.error and str(path) in book.error
    assert [r["name"] for r in book.to_json()] == ["IDLE_GPU"]


def test_rules_export_to_prometheus(tmp_path: Path) -> None:
    book = RuleBook(tmp_path / "r.txt", [IDLE])
    book.add(HOT)
    exported = book.prometheus()
    assert isinstance(exported, dict) and exported
    assert "HOT_GPU" in repr(exported) and "IDLE_GPU" in repr(exported)
