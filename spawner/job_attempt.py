"""What one attempt of a job run executes, the same on every backend (pure: no client, no I/O).

The local runner (``gpulab.spawner.local.jobs``) and the Kubernetes Job builder
(``gpulab.spawner.kube.job_objects``) both start ``python -m gpulab.spawner.singleuser.jobwrapper
run`` and hand it the spec built here, so a job runs identically on both: the same output and
checkpoint directories, the same ``parameters.json``, the same argv for a notebook (papermill with
progress lines), a ``.py`` or a ``.sh`` script, and the same ``GPULAB_JOB_*`` variables. Only how
the spec reaches the wrapper differs (a hub-opened descriptor locally, a Secret volume on
Kubernetes) and how its exit status is recorded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from gpulab.hub.jobs.model import JSONValue, check_relative_path
from gpulab.spawner.names import (
    CHECKPOINT_DIR_ENV,
    JOB_ATTEMPT_ENV,
    JOB_OUTPUT_DIR_ENV,
    JOB_RUN_ID_ENV,
    REPORT_SPEC_KEY,
)

# the wrapper's own names, so that the spec built here and the wrapper that reads it agree
from gpulab.spawner.singleuser.jobwrapper import (
    DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
    RUNNER_REPORTS_START_KEY,
)

WRAPPER_MODULE = "gpulab.spawner.singleuser.jobwrapper"


def run_output_dir(home: str, output_dir: str, run_id: int) -> str:
    """``<home>/<output_dir>/run-<id>``: the run's outputs, the same for every attempt."""
    return os.path.join(home, check_relative_path("output_dir", output_dir), f"run-{run_id}")


def run_checkpoint_dir(home: str, output_dir: str, run_id: int) -> str:
    """``GPULAB_CHECKPOINT_DIR``: kept across attempts, so that a retry resumes from it."""
    return os.path.join(run_output_dir(home, output_dir, run_id), "checkpoints")


def attempt_environment(*, run_id: int, attempt: int, home: str, output_dir: str) -> dict[str, str]:
    """The ``GPULAB_JOB_*`` variables of one attempt (set last: nothing overrides them)."""
    return {
        JOB_RUN_ID_ENV: str(run_id),
        JOB_ATTEMPT_ENV: str(attempt),
        CHECKPOINT_DIR_ENV: run_checkpoint_dir(home, output_dir, run_id),
        JOB_OUTPUT_DIR_ENV: run_output_dir(home, output_dir, run_id),
    }


def wrapper_spec(
    *,
    kind: str,
    path: str,
    home: str,
    output_dir: str,
    run_id: int,
    python: str,
    parameters: Mapping[str, JSONValue] | None = None,
    args: Sequence[str] = (),
    kernel_name: str = "python3",
    report: Mapping[str, str] | None = None,
    kernel_start_timeout_seconds: int = DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
) -> dict[str, Any]:
    """The JSON the wrapper runs: the folder to enter, the directories to make (as the user), the
    notebook's parameters file, and the job's argv (``python``: the interpreter of the machine or
    image the job runs in), and the run's GPU report (``report``: the hub's
    ``ReportTokens.issue``; the spec reaches the wrapper privately, so its token never is in the
    job's environment or command line). ``kernel_start_timeout_seconds``: how long a notebook's
    kernel may take to start before the attempt failed before the job's code (the hub's
    ``GPUJobs.kernel_start_timeout_seconds``). ``ValueError`` for a script that is neither
    ``.py`` nor ``.sh``."""
    input_path = os.path.join(home, check_relative_path("path", path))
    out = run_output_dir(home, output_dir, run_id)
    spec: dict[str, Any] = {
        "cwd": os.path.dirname(input_path),
        "make_dirs": [out, run_checkpoint_dir(home, output_dir, run_id)],
    }
    if kind == "notebook":
        parameters_file = os.path.join(out, "parameters.json")
        spec["parameters_file"] = parameters_file
        spec["parameters"] = dict(parameters or {})
        spec["argv"] = [
            python,
            "-m",
            WRAPPER_MODULE,
            "notebook",
            input_path,
            os.path.join(out, os.path.basename(path)),
            "--parameters-file",
            parameters_file,
            "--kernel",
            kernel_name,
            "--kernel-start-timeout",
            str(int(kernel_start_timeout_seconds)),
        ]
        spec[RUNNER_REPORTS_START_KEY] = True
    elif path.endswith(".sh"):
        spec["argv"] = ["/bin/sh", input_path, *args]
    elif path.endswith(".py"):
        spec["argv"] = [python, input_path, *args]
    else:
        raise ValueError(f"a script must end in .py or .sh, got {path!r:.80}")
    if report:
        spec[REPORT_SPEC_KEY] = dict(report)
    return spec
