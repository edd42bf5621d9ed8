"""ClusterSpec: every refusal names the field to fix; reserved variables cannot be set."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulab.hub.dask import (
    MAX_WORKERS,
    MIN_IDLE_TIMEOUT_SECONDS,
    ClusterSpec,
    ClusterSpecError,
    is_reserved_worker_env_name,
)
from gpulab.hub.jobs import RESERVED_ENV_NAMES
from gpulab.spawner.names import GPU_UUIDS_ENV

from .conftest import make_spec


def refused_field(**changes: object) -> str:
    with pytest.raises(ClusterSpecError) as caught:
        make_spec(**changes)
    assert caught.value.field in str(caught.value)
    return caught.value.field


def test_a_valid_spec_survives_a_json_round_trip():
    spec = make_spec(
        n_workers=3,
        minimum=1,
        maximum=8,
        keep_alive=True,
        idle_timeout_seconds=600,
        environment={"OMP_NUM_THREADS": "4"},
        preemptible=True,
        server="gpu",
    )
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert spec.adaptive
    assert hash(spec) == hash(ClusterSpec.from_dict(spec.to_dict()))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"owner": ""}, "owner"),
        ({"name": "has space"}, "name"),
        ({"name": "-leading-dash"}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"profile": " "}, "profile"),
        ({"profile": 3}, "profile"),
        ({"server": "a/b"}, "server"),
        ({"n_workers": -1}, "n_workers"),
        ({"n_workers": MAX_WORKERS + 1}, "n_workers"),
        ({"n_workers": 2.0}, "n_workers"),
        ({"n_workers": True}, "n_workers"),
        ({"minimum": 1}, "maximum"),  # adaptive needs both
        ({"maximum": 4}, "minimum"),
        ({"minimum": -1, "maximum": 4, "n_workers": 0}, "minimum"),
        ({"minimum": 0, "maximum": 0, "n_workers": 0}, "maximum"),  # an adaptive cluster of none
        ({"minimum": 5, "maximum": 4}, "maximum"),
        ({"minimum": 1, "maximum": 4, "n_workers": 6}, "n_workers"),
        ({"keep_alive": "yes"}, "keep_alive"),
        ({"idle_timeout_seconds": MIN_IDLE_TIMEOUT_SECONDS - 1}, "idle_timeout_seconds"),
        ({"idle_timeout_seconds": 10**9}, "idle_timeout_seconds"),
        ({"environment": ["A=1"]}, "environment"),
        ({"environment": {"1BAD": "x"}}, "environment"),
        ({"environment": {"GOOD": 1}}, "environment.GOOD"),
        ({"environment": {"GOOD": "a\0b"}}, "environment.GOOD"),
        ({"groups": "students"}, "groups"),  # a string, not a list of names
        ({"groups": frozenset({""})}, "groups"),
        ({"preemptible": 1}, "preemptible"),
    ],
)
def test_each_bad_field_is_named(changes, field):
    assert refused_field(**changes) == field


@pytest.mark.parametrize(
    "name",
    [
        *sorted(RESERVED_ENV_NAMES),
        GPU_UUIDS_ENV,
        "JUPYTERHUB_API_TOKEN",
        "CUDA_MPS_PIPE_DIRECTORY",
        "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION",
        "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY",
        "DASK_SCHEDULER_ADDRESS",
    ],
)
def test_variables_gpulab_sets_on_a_worker_are_refused(name):
    # a worker's placement (its GPUs), the hub's identity and the cluster's TLS credentials are
    # gpulab's to set: a spec that set them would forge a share or point the worker elsewhere
    assert refused_field(environment={name: "x"}) == f"environment.{name}"


@given(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True), st.text(max_size=20))
def test_an_environment_variable_is_taken_exactly_when_it_is_not_reserved(name, value):
    value = value.replace("\0", "")
    if is_reserved_worker_env_name(name):
        with pytest.raises(ClusterSpecError):
            make_spec(environment={name: value})
    else:
        assert dict(make_spec(environment={name: value}).environment) == {name: value}


def test_the_environment_cannot_be_changed_after_the_check():
    spec = make_spec(environment={"A": "1"})
    with pytest.raises(TypeError):
        spec.environment["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"  # type: ignore[index]


def test_from_dict_refuses_unknown_and_missing_fields():
    body = make_spec().to_dict()
    with pytest.raises(ClusterSpecError) as caught:
        ClusterSpec.from_dict(body | {"keep_alvie": True})
    assert caught.value.field == "keep_alvie"
    assert "keep_alive" in caught.value.message  # the fields are listed
    del body["profile"]
    with pytest.raises(ClusterSpecError) as missing:
        ClusterSpec.from_dict(body)
    assert missing.value.field == "profile"
    with pytest.raises(ClusterSpecError) as not_object:
        ClusterSpec.from_dict([1, 2])  # type: ignore[arg-type]
    assert not_object.value.field == "spec"


@given(
    n=st.integers(0, MAX_WORKERS),
    low=st.integers(0, MAX_WORKERS),
    high=st.integers(1, MAX_WORKERS),
)
def test_adaptive_limits_are_taken_exactly_when_ordered(n, low, high):
    if low <= n <= high:
        spec = make_spec(n_workers=n, minimum=low, maximum=high)
        assert (spec.minimum, spec.maximum) == (low, high)
    else:
        with pytest.raises(ClusterSpecError) as caught:
            make_spec(n_workers=n, minimum=low, maximum=high)
        assert caught.value.field in {"maximum", "n_workers"}
