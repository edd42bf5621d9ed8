"""jupyter-scheduler's job models <-> the hub's runs: ids, compute types, states, outputs."""

from __future__ import annotations

from typing import Any

import pytest
from jupyter_scheduler.models import CreateJob, DescribeJob, RuntimeEnvironment

from jupyterlab_gpulab import jobmapping

HOME = "/home/alice"


def hub_run(state: str = "queued", **extra: Any) -> dict[str, Any]:
    run: dict[str, Any] = {
        "id": 17,
        "job_id": 4,
        "owner": "alice",
        "spec": {
            "name": "train",
            "kind": "notebook",
            "path": "projects/train.ipynb",
            "profile": "gpu-quarter",
            "parameters": {"lr": 0.001, "optimizer": "adam"},
            "args": [],
            "environment": {},
            "timeout_seconds": None,
            "max_retries": 0,
            "preemptible": False,
            "priority": 0,
            "output_dir": "gpulab-jobs/train",
        },
        "state": state,
        "reason": "",
        "submitted_at": 1000.0,
        "updated_at": 1010.5,
        "attempts": [],
    }
    run.update(extra)
    return run


ATTEMPT = {
    "number": 1,
    "state": "running",
    "node": "local",
    "gpus": "0.25 GPU on node local (GPU-a)",
    "admitted_at": 1001.0,
    "started_at": 1002.0,
    "ended_at": None,
    "exit_code": None,
    "reason": "",
}


def test_a_queued_run_says_where_it_stands_and_why() -> None:
    run = hub_run(queue_position=3, waiting_reason="waiting for quota of group students")
    job = DescribeJob(**jobmapping.describe(run, root_dir=HOME, home=HOME))
    assert job.job_id == "gpulab-17" and job.status.value == "QUEUED"
    assert job.status_message == "queued, position 3: waiting for quota of group students"
    assert job.compute_type == "gpu-quarter" and job.runtime_environment_name == "gpulab"
    assert job.create_time == 1_000_000 and job.start_time is None and job.end_time is None
    assert job.parameters == {"lr": "0.001", "optimizer": '"adam"'}
    assert job.job_files == [] and not job.downloaded


@pytest.mark.parametrize(
    ("state", "status"),
    [
        ("admitted", "IN_PROGRESS"),
        ("running", "IN_PROGRESS"),
        ("succeeded", "COMPLETED"),
        ("failed", "FAILED"),
        ("timed_out", "FAILED"),
        ("preempted", "QUEUED"),
        ("canceled", "STOPPED"),
    ],
)
def test_every_hub_state_has_a_scheduler_status(state: str, status: str) -> None:
    attempt = {**ATTEMPT, "state": state}
    job = jobmapping.describe(hub_run(state, attempts=[attempt]), root_dir=HOME, home=HOME)
    assert job["status"] == status
    assert (job["end_time"] is not None) == (status in ("COMPLETED", "FAILED", "STOPPED"))


def test_a_running_run_names_its_attempt_and_share_and_a_failed_one_its_reason() -> None:
    running = jobmapping.describe(hub_run("running", attempts=[ATTEMPT]), root_dir=HOME, home=HOME)
    assert running["status_message"] == "attempt 1 running on 0.25 GPU on node local (GPU-a)"
    assert running["start_time"] == 1_002_000
    failed = hub_run("failed", reason="exited with status 1", attempts=[ATTEMPT])
    assert jobmapping.status_message(failed) == "exited with status 1"


def test_a_failed_run_whose_retry_waits_is_queued_for_the_scheduler_not_failed() -> None:
    reason = "failed before the job's code started: the kernel did not start"
    waiting = hub_run("failed", reason=reason, retrying=True, attempts=[ATTEMPT])
    job = jobmapping.describe(waiting, root_dir=HOME, home=HOME)
    assert job["status"] == "QUEUED" and job["end_time"] is None
    assert job["status_message"] == f"retrying soon after attempt 1: {reason}"


def test_outputs_are_the_executed_notebook_and_files_as_paths_in_the_server() -> None:
    outputs = [
        {"path": "train.ipynb", "size_bytes": 900},
        {"path": "model.bin", "size_bytes": 10},
        {"path": "parameters.json", "size_bytes": 12},
        {"path": "checkpoints/default/manifest.json", "size_bytes": 40},
    ]
    run = hub_run("succeeded", outputs=outputs)
    job = DescribeJob(**jobmapping.describe(run, root_dir=HOME, home=HOME))
    assert [(f.display_name, f.file_format, f.file_path) for f in job.job_files] == [
        ("Notebook", "ipynb", "gpulab-jobs/train/run-17/train.ipynb"),
        ("model.bin", "files", "gpulab-jobs/train/run-17/model.bin"),
    ]
    assert job.downloaded
    # a server rooted in a subfolder sees paths relative to it, and none outside it
    assert (
        jobmapping.output_paths(run, f"{HOME}/gpulab-jobs", HOME)[0] == "train/run-17/train.ipynb"
    )
    assert jobmapping.output_paths(run, f"{HOME}/projects", HOME) == []


def test_a_create_job_becomes_the_hubs_body_with_the_profile_its_compute_type_names() -> None:
    label = jobmapping.compute_type_label(
        {"slug": "gpu-quarter", "label": "0.25 GPU - 3 free now"},
        "GPU quota: 0.25 GPU in use, 0.75 GPU left",
    )
    assert (
        label == "gpu-quarter | 0.25 GPU - 3 free now | GPU quota: 0.25 GPU in use, 0.75 GPU left"
    )
    create = CreateJob(
        input_uri="projects/train.ipynb",
        runtime_environment_name="gpulab",
        name="my train (v2)",
        compute_type=label,
        parameters={"lr": "0.01", "optimizer": "adam", "layers": "[64, 32]"},
    )
    body = jobmapping.submit_body(
        create.dict(), root_dir=HOME, home=HOME, profiles=["cpu", "gpu-quarter"]
    )
    assert body == {
        "name": "my-train-v2",
        "kind": "notebook",
        "path": "projects/train.ipynb",
        "profile": "gpu-quarter",
        "parameters": {"lr": 0.01, "optimizer": "adam", "layers": [64, 32]},
    }
    script = jobmapping.submit_body(
        {"input_uri": "run.py", "name": "", "compute_type": None},
        root_dir=f"{HOME}/projects",
        home=HOME,
        profiles=["gpu-1"],
    )
    assert script == {
        "name": "run",
        "kind": "script",
        "path": "projects/run.py",
        "profile": "gpu-1",
    }


def test_what_no_run_can_be_is_refused_naming_the_field() -> None:
    with pytest.raises(jobmapping.MappingError) as e:
        jobmapping.submit_body(
            {"input_uri": "../bob/x.ipynb", "name": "x"}, root_dir=HOME, home=HOME, profiles=["a"]
        )
    assert e.value.field == "input_uri"
    with pytest.raises(jobmapping.MappingError) as e:
        jobmapping.submit_body(
            {"input_uri": "x.ipynb", "name": "x"}, root_dir=HOME, home=HOME, profiles=[]
        )
    assert e.value.field == "compute_type"
    for bad in ("17", "gpulab-", "gpulab-1x", "6a1b-uuid", "gpulab-" + "9" * 19):
        with pytest.raises(jobmapping.MappingError):
            jobmapping.run_id(bad)
    assert jobmapping.run_id("gpulab-17") == 17
    assert jobmapping.job_name("...") == "job"


def test_the_environment_model_takes_profiles_as_compute_types() -> None:
    # the fields jupyter-scheduler's form reads: compute_types and a default among them
    types = ["cpu | no GPU", "gpu-quarter | 0.25 GPU - 3 free now"]
    env = RuntimeEnvironment(
        name="gpulab",
        label="GPU job (gpulab)",
        description="",
        file_extensions=["ipynb"],
        output_formats=["ipynb"],
        metadata={},
        compute_types=types,
        default_compute_type=types[1],
    )
    assert jobmapping.profile_of(env.default_compute_type, []) == "gpu-quarter"
