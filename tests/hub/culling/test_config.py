"""CullPolicy.from_config: defaults, per-profile overrides, and refusals that name the field."""

from __future__ import annotations

from typing import Any

import pytest

from gpulab.hub.culling import CullConfigError, CullPolicy, CullRule


def test_an_empty_config_is_the_documented_defaults_in_dry_run() -> None:
    policy = CullPolicy.from_config({})
    assert policy.dry_run is True
    assert policy.stale_sample_seconds == 120
    assert policy.default.to_dict() == {
        "ui_idle_seconds": 3600,
        "gpu_utilization_pct": 5.0,
        "gpu_idle_seconds": 1800,
        "warn_seconds": 900,
        "keep_alive_seconds": 14400,
        "action": "checkpoint-stop",
        "enabled": True,
    }


def test_a_profile_override_is_merged_over_the_configured_default() -> None:
    policy = CullPolicy.from_config(
        {
            "default": {"ui_idle_seconds": 1800, "warn_seconds": 600},
            "profiles": {"gpu-full": {"gpu_idle_seconds": 900, "action": "downsize"}},
        },
        known_profiles=["gpu-full", "gpu-quarter"],
    )
    assert policy.rule_for("gpu-full") == CullRule(
        ui_idle_seconds=1800, gpu_idle_seconds=900, warn_seconds=600, action="downsize"
    )
    assert policy.rule_for("gpu-quarter") == CullRule(ui_idle_seconds=1800, warn_seconds=600)
    assert policy.rule_for("") is policy.default


def test_integral_floats_are_seconds_too() -> None:
    rule = CullRule.from_dict({"ui_idle_seconds": 7200.0, "gpu_utilization_pct": 2})
    assert (rule.ui_idle_seconds, rule.gpu_utilization_pct) == (7200, 2.0)


def test_a_warning_of_zero_seconds_is_allowed() -> None:
    assert CullRule.from_dict({"warn_seconds": 0}).warn_seconds == 0


@pytest.mark.parametrize(
    ("config", "field", "message"),
    [
        ({"default": {"ui_idle_secs": 60}}, "default.ui_idle_secs", "no such rule field; known: "),
        (
            {"default": {"ui_idle_seconds": True}},
            "default.ui_idle_seconds",
            "whole number of seconds, got True",
        ),
        (
            {"default": {"ui_idle_seconds": "1h"}},
            "default.ui_idle_seconds",
            "whole number of seconds, got '1h'",
        ),
        (
            {"default": {"ui_idle_seconds": 90.5}},
            "default.ui_idle_seconds",
            "whole number of seconds, got 90.5",
        ),
        (
            {"default": {"gpu_idle_seconds": 30}},
            "default.gpu_idle_seconds",
            "30 s is outside 60..604800 s",
        ),
        ({"default": {"warn_seconds": -1}}, "default.warn_seconds", "-1 s is outside 0..604800 s"),
        (
            {"default": {"gpu_utilization_pct": 0}},
            "default.gpu_utilization_pct",
            "set enabled to false",
        ),
        (
            {"default": {"gpu_utilization_pct": 101}},
            "default.gpu_utilization_pct",
            "outside (0, 100]",
        ),
        (
            {"default": {"gpu_utilization_pct": float("nan")}},
            "default.gpu_utilization_pct",
            "a percentage",
        ),
        (
            {"default": {"action": "delete"}},
            "default.action",
            "use one of stop, checkpoint-stop, downsize",
        ),
        ({"default": {"enabled": "yes"}}, "default.enabled", "expected true or false"),
        ({"default": [1]}, "default", "expected a mapping of rule fields"),
        (
            {"profiles": {"gpu-full": {"warn_seconds": "soon"}}},
            "profiles.gpu-full.warn_seconds",
            "got 'soon'",
        ),
        ({"profiles": ["gpu-full"]}, "profiles", "expected a mapping of profile slug to rule"),
        ({"dry_run": "false"}, "dry_run", "expected true or false, got 'false'"),
        ({"stale_sample_seconds": 0}, "stale_sample_seconds", "0 s is outside 1..3600 s"),
        ({"dryrun": True}, "dryrun", "no such setting; known: default, dry_run, profiles"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(
    config: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(CullConfigError) as refused:
        CullPolicy.from_config(config)
    assert refused.value.field == field
    assert message in refused.value.message
    assert str(refused.value).startswith(f"{field}: ")


def test_an_override_for_a_profile_the_catalog_lacks_is_refused() -> None:
    with pytest.raises(CullConfigError) as refused:
        CullPolicy.from_config(
            {"profiles": {"gpu-ful": {"enabled": False}}}, known_profiles=["gpu-full", "cpu"]
        )
    assert str(refused.value) == (
        "profiles.gpu-ful: no profile 'gpu-ful' in the catalog; known: cpu, gpu-full"
    )


def test_a_policy_survives_a_round_trip_through_its_dict() -> None:
    policy = CullPolicy.from_config(
        {"dry_run": False, "profiles": {"gpu-full": {"enabled": False, "warn_seconds": 60}}}
    )
    assert CullPolicy.from_config(policy.to_dict()) == policy
