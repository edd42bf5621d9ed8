"""Job definitions: what is accepted, and every refusal naming the field to fix."""

from __future__ import annotations

import math

import pytest

from gpulab.hub.jobs import MAX_RETRIES, JobSpec, JobSpecError, is_reserved_env_name
from tests.harness.jobs import make_spec


def test_a_notebook_job_keeps_its_json_parameters_and_round_trips_through_a_dict():
    spec = make_spec(
        kind="notebook",
        path="./analysis/run.ipynb",
        parameters={"lr": 0.001, "epochs": 3, "layers": [64, 32], "opts": {"amp": True}},
        groups=["students"],
        environment={"WANDB_MODE": "offline"},
        timeout_seconds=3600,
        max_retries=2,
        preemptible=True,
        priority=5,
    )
    assert spec.path == "analysis/run.ipynb"  # normalised
    assert spec.groups == frozenset({"students"})
    assert spec.parameters["layers"] == [64, 32]
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_equal_specs_hash_alike_so_they_can_key_a_dict():
    a = make_spec(kind="notebook", path="a.ipynb", parameters={"x": [1, {"y": 2}]})
    b = JobSpec.from_dict(a.to_dict())
    assert {a: "first"}[b] == "first"


def test_the_output_directory_defaults_to_one_per_job_name():
    assert make_spec(name="resnet-50").output_dir == "gpulab-jobs/resnet-50"
    assert make_spec(output_dir="out/x/").output_dir == "out/x"


def test_a_script_keeps_its_arguments_in_order():
    spec = make_spec(args=["--epochs", "3", "--name", "a b"])
    assert spec.args == ("--epochs", "3", "--name", "a b")


def test_parameters_are_copied_so_the_caller_cannot_change_a_stored_spec():
    params = {"layers": [1, 2]}
    spec = make_spec(kind="notebook", path="a.ipynb", parameters=params)
    params["layers"].append(3)
    params["new"] = 1
    assert spec.parameters == {"layers": [1, 2]}


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"owner": ""}, "owner", "non-empty"),
        ({"name": "../etc"}, "name", "letters, digits"),
        ({"name": "a" * 65}, "name", "1-64"),
        ({"kind": "docker"}, "kind", "'notebook' or 'script'"),
        ({"path": "/etc/passwd"}, "path", "relative to your home"),
        ({"path": "/home/alice/train.py"}, "path", "absolute"),
        ({"path": "../bob/train.py"}, "path", "'..'"),
        ({"path": "a/../../train.py"}, "path", "'..'"),
        ({"path": ""}, "path", "non-empty"),
        ({"path": "."}, "path", "name a file"),
        ({"path": "a\\b.py"}, "path", "POSIX"),
        ({"path": "train.ipynb"}, "path", "kind 'notebook'"),
        ({"path": "train.txt"}, "path", ".py or .sh"),
        ({"kind": "notebook", "path": "train.py"}, "path", ".ipynb"),
        ({"profile": ""}, "profile", "non-empty"),
        ({"groups": "students"}, "groups", "list of names"),
        ({"groups": [""]}, "groups", "non-empty"),
        ({"args": "--epochs 3"}, "args", "list of strings"),
        ({"args": ["ok", 3]}, "args[1]", "string"),
        ({"kind": "notebook", "path": "a.ipynb", "args": ["x"]}, "args", "parameters"),
        ({"parameters": {"a": 1}}, "parameters", "args"),
        ({"kind": "notebook", "path": "a.ipynb", "parameters": []}, "parameters", "JSON object"),
        ({"kind": "notebook", "path": "a.ipynb", "parameters": {"1x": 1}}, "parameters", "Python"),
        (
            {"kind": "notebook", "path": "a.ipynb", "parameters": {"class": 1}},
            "parameters",
            "Python",
        ),
        (
            {"kind": "notebook", "path": "a.ipynb", "parameters": {"a": {1, 2}}},
            "parameters.a",
            "JSON",
        ),
        (
            {"kind": "notebook", "path": "a.ipynb", "parameters": {"a": math.nan}},
            "parameters.a",
            "finite",
        ),
        (
            {"kind": "notebook", "path": "a.ipynb", "parameters": {"a": [math.inf]}},
            "parameters.a[0]",
            "finite",
        ),
        (
            {"kind": "notebook", "path": "a.ipynb", "parameters": {"a": {2: 1}}},
            "parameters.a",
            "key",
        ),
        (
            {"kind": "notebook", "path": "a.ipynb", "parameters": {"a": "x" * 70_000}},
            "parameters",
            "KiB",
        ),
        ({"environment": ["A=1"]}, "environment", "map"),
        ({"environment": {"1A": "x"}}, "environment", "letters, digits"),
        ({"environment": {"A-B": "x"}}, "environment", "letters, digits"),
        ({"environment": {"A": 1}}, "environment.A", "string"),
        (
            {"environment": {"CUDA_VISIBLE_DEVICES": "0,1"}},
            "environment.CUDA_VISIBLE_DEVICES",
            "cannot be overridden",
        ),
        (
            {"environment": {"NVIDIA_VISIBLE_DEVICES": "all"}},
            "environment.NVIDIA_VISIBLE_DEVICES",
            "placement",
        ),
        (
            {"environment": {"JUPYTERHUB_API_TOKEN": "t"}},
            "environment.JUPYTERHUB_API_TOKEN",
            "hub identity",
        ),
        (
            {"environment": {"GPULAB_GPU_FRACTION": "1"}},
            "environment.GPULAB_GPU_FRACTION",
            "reserved",
        ),
        (
            {"environment": {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=80G"}},
            "environment.CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "reserved",
        ),
        ({"timeout_seconds": -1}, "timeout_seconds", "at least 1"),
        ({"timeout_seconds": 0}, "timeout_seconds", "at least 1"),
        ({"timeout_seconds": 1.5}, "timeout_seconds", "integer"),
        ({"timeout_seconds": True}, "timeout_seconds", "integer"),
        ({"max_retries": MAX_RETRIES + 1}, "max_retries", "between 0 and 10"),
        ({"max_retries": -1}, "max_retries", "between 0 and 10"),
        ({"max_retries": "3"}, "max_retries", "integer"),
        ({"preemptible": "yes"}, "preemptible", "true or false"),
        ({"priority": 10**6}, "priority", "between -1000 and 1000"),
        ({"output_dir": "/tmp/out"}, "output_dir", "absolute"),
        ({"output_dir": "../out"}, "output_dir", "'..'"),
    ],
)
def test_each_refusal_names_the_field_to_fix(overrides, field, words):
    with pytest.raises(JobSpecError) as caught:
        make_spec(**overrides)
    assert caught.value.field == field
    assert words in caught.value.message
    assert str(caught.value).startswith(f"{field}: ")


def test_from_dict_refuses_an_unknown_field_rather_than_ignoring_it():
    data = make_spec().to_dict() | {"max_retires": 3}
    with pytest.raises(JobSpecError) as caught:
        JobSpec.from_dict(data)
    assert caught.value.field == "max_retires"
    assert "max_retries" in caught.value.message


def test_from_dict_names_a_missing_required_field():
    data = make_spec().to_dict()
    del data["profile"]
    with pytest.raises(JobSpecError) as caught:
        JobSpec.from_dict(data)
    assert caught.value.field == "profile"


def test_from_dict_refuses_what_is_not_an_object():
    with pytest.raises(JobSpecError) as caught:
        JobSpec.from_dict(["not", "an", "object"])  # type: ignore[arg-type]
    assert caught.value.field == "spec"


def test_ordinary_environment_variables_are_accepted():
    env = {"WANDB_MODE": "offline", "HF_HOME": "~/.cache/hf", "_X1": "", "OMP_NUM_THREADS": "4"}
    assert dict(make_spec(environment=env).environment) == env


@pytest.mark.parametrize(
    ("name", "reserved"),
    [
        ("CUDA_VISIBLE_DEVICES", True),
        ("PYTORCH_CUDA_ALLOC_CONF", True),
        ("XLA_PYTHON_CLIENT_MEM_FRACTION", True),
        ("GPULAB_CHECKPOINT_DIR", True),
        ("JUPYTERHUB_USER", True),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", True),
        ("CUDA_HOME", False),
        ("GPULABX", False),
        ("MY_GPULAB_FLAG", False),
    ],
)
def test_reserved_names_are_the_placement_and_hub_identity_ones(name, reserved):
    assert is_reserved_env_name(name) is reserved
