"""Between jupyter-scheduler's job models and the hub's GPU job runs (pure: dicts in, dicts out).

jupyter-scheduler's UI and REST API speak `CreateJob` / `DescribeJob`; the hub's jobs API speaks
runs (`docs/rest-api.yaml`). Here:

- a run's id `17` is the job id `gpulab-17` (jupyter-scheduler's routes only take ids with a '-');
- a compute type is a GPU profile, shown with its live capacity and the owner's remaining quota
  (`gpu-quarter | 0.25 GPU - 3 free now | GPU quota: 0.25 GPU in use, 0.75 GPU left`): the slug
  is everything before the first ` | `, so a label that changed since the form opened still
  names the profile;
- states: queued (and a retry waiting its turn) -> QUEUED with the queue position and the hub's
  reason ("waiting for quota of group students") in `status_message`; admitted and running ->
  IN_PROGRESS; succeeded -> COMPLETED; failed and timed out -> FAILED with the reason; canceled
  -> STOPPED;
- outputs: the executed notebook (`<output_dir>/run-<id>/<notebook>`) and every file the run
  wrote there, as paths relative to the server's root, already in place (`downloaded`), since the
  run wrote them into the owner's home.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Mapping
from typing import Any

JOB_ID_PREFIX = "gpulab-"
#: the hub's `gpus` of a profile without a GPU (`gpulab.hub.profiles.format_gpus`)
CPU_ONLY = "CPU only"
ENVIRONMENT_NAME = "gpulab"
LABEL_SEPARATOR = " | "
#: what gpulab itself keeps in a run's folder (the parameters it injected, the checkpoints a retry
#: resumes from): not outputs a person looks for
BOOKKEEPING_FILES = frozenset({"parameters.json"})
BOOKKEEPING_DIRS = ("checkpoints/",)
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

QUEUED, IN_PROGRESS, COMPLETED, FAILED, STOPPED = (
    "QUEUED",
    "IN_PROGRESS",
    "COMPLETED",
    "FAILED",
    "STOPPED",
)
STATUS_OF_STATE = {
    "queued": QUEUED,
    "admitted": IN_PROGRESS,
    "running": IN_PROGRESS,
    "succeeded": COMPLETED,
    "failed": FAILED,
    "timed_out": FAILED,
    "preempted": QUEUED,  # the hub queues a preempted run again: it does not count as a failure
    "canceled": STOPPED,
}
#: jupyter-scheduler's status -> the hub states it covers (for list filters)
STATES_OF_STATUS: dict[str, frozenset[str]] = {}
for _state, _status in STATUS_OF_STATE.items():
    STATES_OF_STATUS[_status] = STATES_OF_STATUS.get(_status, frozenset()) | {_state}


class MappingError(ValueError):
    """A job jupyter-scheduler asked for that no run can be; ``field`` names what to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def job_id(run_id: int) -> str:
    return f"{JOB_ID_PREFIX}{run_id}"


def run_id(job_id_text: str) -> int:
    """The hub's run id in a job id; MappingError for anything else (ids of the stock scheduler
    included, so they are never sent to the hub)."""
    digits = job_id_text.removeprefix(JOB_ID_PREFIX)
    well_formed = digits.isascii() and digits.isdigit() and len(digits) <= 18
    if job_id_text.startswith(JOB_ID_PREFIX) and well_formed:
        return int(digits)
    raise MappingError(
        "job_id", f"not a gpulab job id ('{JOB_ID_PREFIX}<run>'): {job_id_text!r:.80}"
    )


def compute_type_label(profile: Mapping[str, Any], quota: str | None) -> str:
    """A profile as a compute type: its slug, what it gives and how much is free, the quota."""
    parts = [str(profile["slug"]), str(profile.get("label") or profile.get("gpus") or "")]
    if quota:
        parts.append(quota)
    return LABEL_SEPARATOR.join(p for p in parts if p)


def has_gpu(profile: Mapping[str, Any]) -> bool:
    """Whether a profile of the hub's capacity gives a GPU (the forms open on the first that does)."""
    return profile.get("gpus") not in (None, CPU_ONLY)


def profile_of(compute_type: str | None, profiles: list[str]) -> str:
    """The profile slug a compute type names (the first listed when the form sent none)."""
    if not compute_type:
        if not profiles:
            raise MappingError("compute_type", "no GPU profile is open to you on this hub")
        return profiles[0]
    return compute_type.split(LABEL_SEPARATOR, 1)[0].strip()


def job_name(name: str) -> str:
    """A hub job name (letters, digits, '.', '_', '-'; up to 64) from a free-text one."""
    safe = _NAME_UNSAFE.sub("-", name).strip("-._")[:64]
    return safe or "job"


def parameters(raw: Mapping[str, str] | None) -> dict[str, Any]:
    """jupyter-scheduler's string parameters as JSON values where they parse (`0.001`, `true`,
    `[1, 2]`), else as the string itself (`adam`), as a person typing them means."""
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        try:
            out[key] = json.loads(value)
        except (TypeError, ValueError):
            out[key] = value
    return out


def home_relative(input_uri: str, root_dir: str, home: str) -> str:
    """The input file's path relative to the owner's home, where the hub runs it."""
    full = os.path.normpath(os.path.join(root_dir, input_uri))
    relative = os.path.relpath(full, home)
    if relative == os.curdir or relative.startswith(os.pardir + os.sep) or relative == os.pardir:
        raise MappingError(
            "input_uri", f"a job runs a file in your home folder, not {input_uri!r:.80}"
        )
    return relative.replace(os.sep, "/")


def submit_body(
    create: Mapping[str, Any], *, root_dir: str, home: str, profiles: list[str]
) -> dict[str, Any]:
    """The hub's POST body for a jupyter-scheduler `CreateJob` (as a dict)."""
    path = home_relative(str(create["input_uri"]), root_dir, home)
    kind = "notebook" if path.endswith(".ipynb") else "script"
    body: dict[str, Any] = {
        "name": job_name(str(create.get("name") or posixpath.basename(path).rsplit(".", 1)[0])),
        "kind": kind,
        "path": path,
        "profile": profile_of(create.get("compute_type"), profiles),
    }
    if kind == "notebook" and create.get("parameters"):
        body["parameters"] = parameters(create["parameters"])
    return body


def status_message(run: Mapping[str, Any]) -> str:
    """One line for people: where a queued run stands and why, what a running one runs on, why
    one ended as it did."""
    state = str(run["state"])
    attempts = list(run.get("attempts") or [])
    if state in ("queued", "preempted"):
        position = run.get("queue_position")
        where = f"queued, position {position}" if position else "queued"
        why = run.get("waiting_reason") or run.get("reason") or ""
        return f"{where}: {why}" if why else where
    if run.get("retrying"):
        return f"retrying soon after attempt {len(attempts)}: {run.get('reason') or state}"
    if state in ("admitted", "running") and attempts:
        verb = "starting" if state == "admitted" else "running"
        return f"attempt {len(attempts)} {verb} on {attempts[-1]['gpus']}"
    return str(run.get("reason") or state.replace("_", " "))


def output_paths(run: Mapping[str, Any], root_dir: str, home: str) -> list[str]:
    """The run's output files as paths relative to the server's root (those it can reach), but
    gpulab's own bookkeeping."""
    spec = run["spec"]
    base = posixpath.join(str(spec["output_dir"]), f"run-{run['id']}")
    names = [
        str(o["path"])
        for o in run.get("outputs") or []
        if o["path"] not in BOOKKEEPING_FILES and not str(o["path"]).startswith(BOOKKEEPING_DIRS)
    ]
    out = []
    for name in names:
        full = os.path.normpath(os.path.join(home, base, name))
        relative = os.path.relpath(full, root_dir)
        if not relative.startswith(os.pardir):
            out.append(relative.replace(os.sep, "/"))
    return out


def describe(run: Mapping[str, Any], *, root_dir: str, home: str) -> dict[str, Any]:
    """A jupyter-scheduler `DescribeJob` (as a dict) for a hub run; times in milliseconds."""
    spec = run["spec"]
    attempts = list(run.get("attempts") or [])
    started = next((a["started_at"] for a in attempts if a.get("started_at")), None)
    # an ended attempt whose retry waits (a platform failure's back-off) is queued again soon
    status = QUEUED if run.get("retrying") else STATUS_OF_STATE.get(str(run["state"]), FAILED)
    ended = run.get("updated_at") if status in (COMPLETED, FAILED, STOPPED) else None
    notebook = spec["kind"] == "notebook"
    files: list[dict[str, Any]] = []
    executed = posixpath.basename(str(spec["path"]))
    for path in output_paths(run, root_dir, home):
        is_notebook = notebook and posixpath.basename(path) == executed
        files.append(
            {
                "display_name": "Notebook" if is_notebook else posixpath.basename(path),
                "file_format": "ipynb" if is_notebook else "files",
                "file_path": path,
            }
        )
    return {
        "job_id": job_id(int(run["id"])),
        "name": str(spec["name"]),
        "input_filename": posixpath.basename(str(spec["path"])),
        "runtime_environment_name": ENVIRONMENT_NAME,
        "compute_type": str(spec["profile"]),
        "output_formats": ["ipynb"] if notebook else [],
        "parameters": {k: json.dumps(v) for k, v in dict(spec.get("parameters") or {}).items()},
        "url": f"/jobs/{job_id(int(run['id']))}",
        "create_time": _ms(run["submitted_at"]),
        "update_time": _ms(run.get("updated_at") or run["submitted_at"]),
        "start_time": _ms(started) if started else None,
        "end_time": _ms(ended) if ended else None,
        "status": status,
        "status_message": status_message(run),
        "job_files": files,
        "downloaded": bool(files),
        "tags": [],
    }


def _ms(seconds: float) -> int:
    return int(float(seconds) * 1000)
