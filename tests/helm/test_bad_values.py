"""Bad values are refused before anything reaches a cluster, with a message naming the field:
the schema (values.schema.json, checked by Helm on install, upgrade, lint and template) and the
templates' own checks of what a schema cannot say."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from helm_python import HelmError


def refusal(check: ModuleType, values: dict[str, Any]) -> str:
    with pytest.raises(HelmError) as caught:
        check.render(values)
    return str(caught.value)


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"hub": {"bogus": 1}}, ["/hub", "'bogus' not allowed"]),
        (
            {"singleuser": {"networkPolicy": {"allowInternett": False}}},
            ["/singleuser/networkPolicy", "allowInternett"],
        ),
        (
            {"placeholders": {"profiles": {"gpu-1": {"count": -1}}}},
            ["/placeholders/profiles/gpu-1/count", "minimum"],
        ),
        ({"gpulab": {"sharing": "mps"}}, ["/gpulab/sharing", "must be one of"]),
        ({"hub": {"cookieSecret": "not-hex"}}, ["/hub/cookieSecret"]),
        ({"gpulab": {"profiles": [{"slug": "Big GPU", "gpus": 1}]}}, ["/gpulab/profiles/0/slug"]),
        ({"gpulab": {"profiles": [{"display_name": "no slug"}]}}, ["/gpulab/profiles/0", "slug"]),
        ({"gpulab": {"quotas": {"headroomFraction": 1}}}, ["/gpulab/quotas/headroomFraction"]),
        ({"gpulab": {"metrics": {"port": 8081}}}, ["/gpulab/metrics/port"]),
        ({"hub": {"db": {"type": "mysql"}}}, ["/hub/db/type", "must be one of"]),
        ({"singleuser": {"uid": 0}}, ["/singleuser/uid", "minimum"]),
        (
            {"singleuser": {"podSecurity": {"enforce": "strict"}}},
            ["/singleuser/podSecurity/enforce", "must be one of"],
        ),
        (
            {"singleuser": {"podSecurity": {"version": "1.37"}}},
            ["/singleuser/podSecurity/version"],
        ),
        (
            {"gpulab": {"jobs": {"kernelStartTimeoutSeconds": 0}}},
            ["/gpulab/jobs/kernelStartTimeoutSeconds", "minimum"],
        ),
    ],
)
def test_the_schema_refuses_a_bad_value_naming_its_field(
    check: ModuleType, values: dict[str, Any], names: list[str]
) -> None:
    message = refusal(check, values)
    for name in names:
        assert name in message, message


def test_postgresql_without_a_url_is_refused(check: ModuleType) -> None:
    assert "hub.db.url" in refusal(check, {"hub": {"db": {"type": "postgresql"}}})


def test_a_placeholder_for_a_profile_that_does_not_exist_is_refused(check: ModuleType) -> None:
    values = {"placeholders": {"enabled": True, "profiles": {"gpu-3": {"count": 1}}}}
    message = refusal(check, values)
    assert "placeholders.profiles.gpu-3" in message and "gpulab.profiles" in message


def test_a_placeholder_of_a_cpu_profile_is_refused(check: ModuleType) -> None:
    values = {"placeholders": {"enabled": True, "profiles": {"cpu": {"count": 1}}}}
    assert "placeholders.profiles.cpu" in refusal(check, values)


def test_a_fraction_on_mig_needs_the_placeholders_resources_named(check: ModuleType) -> None:
    values = {"placeholders": {"enabled": True, "profiles": {"gpu-quarter": {"count": 1}}}}
    message = refusal(check, values)
    assert "placeholders.profiles.gpu-quarter.resources" in message and "mig" in message
    values["placeholders"]["profiles"]["gpu-quarter"]["resources"] = {"nvidia.com/mig-2g.20gb": "1"}
    check.render(values)


def test_a_snapshot_class_to_create_needs_a_driver(check: ModuleType) -> None:
    values = {"singleuser": {"snapshotClass": {"name": "homes", "create": True}}}
    assert "singleuser.snapshotClass" in refusal(check, values)
