"""How the Kubernetes job executor reads an attempt's end from the Job and pod the API server
returns (their real shapes, as dicts) and its outputs from the end of the pod's log."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gpulab.hub.jobs import Cancel, Fail, Preempt, Succeed, TimeOut
from gpulab.spawner.kube.job_outcomes import (
    KubeOutcome,
    creation_failure,
    finished_outcome,
    job_finished,
    outputs_from_log,
    refused_by_pod_security,
    waiting_reason,
)


def job(condition: str | None, reason: str = "") -> dict[str, Any]:
    conditions = (
        [] if condition is None else [{"type": condition, "status": "True", "reason": reason}]
    )
    return {"metadata": {"name": "gpulab-job-alice-3-1"}, "status": {"conditions": conditions}}


def pod(
    terminated: dict[str, Any] | None = None, waiting: dict[str, Any] | None = None
) -> dict[str, Any]:
    state = {"terminated": terminated} if terminated else {"waiting": waiting or {}}
    return {"status": {"phase": "Failed", "containerStatuses": [{"name": "job", "state": state}]}}


def test_the_jobs_conditions_and_the_containers_exit_code_make_the_runs_event():
    assert job_finished(job(None)) is None
    assert job_finished({"status": {"conditions": [{"type": "Failed", "status": "False"}]}}) is None
    assert finished_outcome(job("Complete"), pod()).event(5.0) == Succeed(5.0)
    deadline = finished_outcome(job("Failed", "DeadlineExceeded"), pod({"exitCode": 143}))
    assert deadline.event(5.0) == TimeOut(5.0)
    failed = finished_outcome(job("Failed", "BackoffLimitExceeded"), pod({"exitCode": 3}))
    assert failed.event(5.0) == Fail(5.0, reason="exit code 3", exit_code=3)
    gone = finished_outcome(job("Failed", "BackoffLimitExceeded"), None)
    assert gone.event(5.0) == Fail(5.0, reason="its Job failed (BackoffLimitExceeded)")
    assert KubeOutcome("canceled").event(5.0) == Cancel(5.0)
    lost = KubeOutcome("lost", "node gj-x was lost").event(5.0)
    assert lost == Preempt(5.0, reason="node gj-x was lost", platform_failure=True)
    assert KubeOutcome.from_dict({"kind": "failed", "reason": "r", "exit_code": 2}) == KubeOutcome(
        "failed", "r", 2
    )


def test_a_pod_that_cannot_start_says_why_in_the_kubelets_words():
    stuck = pod(waiting={"reason": "CreateContainerConfigError", "message": "runAsNonRoot"})
    assert waiting_reason(stuck) == "CreateContainerConfigError: runAsNonRoot"
    unschedulable = {
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "message": "0/3"}]}
    }
    assert waiting_reason(unschedulable) == "0/3"
    assert waiting_reason(None) == ""


def test_outputs_are_the_last_listing_line_of_the_log_and_nothing_else():
    line = b'gpulab job: outputs {"files":[["model.bin",10],["checkpoints/c",2]],"more":false}\n'
    assert outputs_from_log(b"epoch 1\n" + line) == [("model.bin", 10), ("checkpoints/c", 2)]
    assert outputs_from_log(line) == [("model.bin", 10), ("checkpoints/c", 2)]
    # the wrapper's line is the last one: an earlier one the job printed does not count
    forged = b'gpulab job: outputs {"files":[["x",1]],"more":false}\n'
    assert outputs_from_log(forged + b"more\n" + line) == [("model.bin", 10), ("checkpoints/c", 2)]
    assert outputs_from_log(b"no listing\n") == []
    assert outputs_from_log(b"gpulab job: outputs {not json\n") == []
    assert outputs_from_log(b'gpulab job: outputs {"files":[["/etc/passwd",1],["../x",1]]}') == []
    # "a line" means at the start of one
    assert outputs_from_log(b'say gpulab job: outputs {"files":[["y",1]]}\n') == []


def test_a_pod_that_failed_before_the_jobs_code_started_is_the_platforms_failure():
    said = b"gpulab job: failed before the job's code started: the kernel did not start: late\n"
    kernel = finished_outcome(job("Failed", "BackoffLimitExceeded"), pod({"exitCode": 75}), said)
    assert kernel.event(5.0) == Fail(
        5.0,
        reason="failed before the job's code started: the kernel did not start: late",
        exit_code=75,
        platform_failure=True,
    )
    # a script's own exit 75, without the wrapper's line, is the script's failure
    own = finished_outcome(job("Failed", "BackoffLimitExceeded"), pod({"exitCode": 75}), b"x\n")
    assert own.event(5.0) == Fail(5.0, reason="exit code 75", exit_code=75)
    evicted = {"status": {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}}
    outcome = finished_outcome(job("Failed", "BackoffLimitExceeded"), evicted)
    assert outcome.platform_failure and outcome.reason == "evicted by its node: low on memory"
    assert KubeOutcome.from_dict(asdict(outcome)) == outcome  # as result.json keeps it


def failed_create(message: str, at: str, reason: str = "FailedCreate") -> dict[str, Any]:
    """A core/v1 Event as the Job controller records a pod it could not create."""
    return {"reason": reason, "type": "Warning", "message": message, "lastTimestamp": at}


def test_why_a_job_made_no_pod_is_its_newest_failedcreate_and_pod_security_is_final() -> None:
    refused = (
        'Error creating: pods "gpulab-job-rita-4-1-x7" is forbidden: violates PodSecurity '
        '"restricted:latest": runAsNonRoot != true (pod or container "job" must set '
        "securityContext.runAsNonRoot=true)"
    )
    quota = 'Error creating: pods "p" is forbidden: exceeded quota: compute'
    events = [
        failed_create(quota, "2026-12-07T10:00:01Z"),
        failed_create(refused, "2026-12-07T10:00:05Z"),
        failed_create("Created pod: p", "2026-12-07T10:00:09Z", reason="SuccessfulCreate"),
    ]
    assert creation_failure(events) == refused
    assert refused_by_pod_security(creation_failure(events))
    assert creation_failure(events[:1]) == quota
    assert not refused_by_pod_security(quota)  # a quota may free up: the start waits for it
    assert creation_failure(events[2:]) == ""
    assert creation_failure([]) == ""
