"""Helpers for the jobs tests (and the jobs benchmark): specs, events, runs in any state; files in
a hub user's home and her token for the job REST API and CLI."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
from traitlets.config import Config

from gpulab.hub.allocator import GpuShare
from gpulab.hub.jobs import (
    Admit,
    Cancel,
    Event,
    Fail,
    JobSpec,
    PlacementSummary,
    Preempt,
    Retry,
    Run,
    RunState,
    Start,
    Succeed,
    TimeOut,
    transition,
)
from tests.harness.hub import Hub

PLACEMENT = PlacementSummary("a1", (GpuShare("a1-gpu0", 250),))


def make_spec(**overrides: Any) -> JobSpec:
    """A valid script job of alice's, with ``overrides``."""
    values: dict[str, Any] = {
        "owner": "alice",
        "name": "train",
        "kind": "script",
        "path": "projects/train.py",
        "profile": "gpu-quarter",
    }
    values.update(overrides)
    return JobSpec(**values)


def make_event(kind: type[Event], at: float = 100.0) -> Event:
    """An event of ``kind`` with the fields it needs (Admit gets ``PLACEMENT``)."""
    if kind is Admit:
        return Admit(at, PLACEMENT)
    return kind(at)


#: from a new queued run, the events that lead to each state
PATHS: dict[RunState, tuple[type[Event], ...]] = {
    RunState.QUEUED: (),
    RunState.ADMITTED: (Admit,),
    RunState.RUNNING: (Admit, Start),
    RunState.SUCCEEDED: (Admit, Start, Succeed),
    RunState.FAILED: (Admit, Start, Fail),
    RunState.CANCELED: (Cancel,),
    RunState.PREEMPTED: (Admit, Start, Preempt),
    RunState.TIMED_OUT: (Admit, Start, TimeOut),
}

ALL_EVENTS: tuple[type[Event], ...] = (
    Admit,
    Start,
    Succeed,
    Fail,
    Cancel,
    Preempt,
    TimeOut,
    Retry,
)


def new_run(max_retries: int = 0, **spec: Any) -> Run:
    """Run 1 of job 1, queued at t=0."""
    return Run.submitted(1, 1, make_spec(max_retries=max_retries, **spec), at=0.0)


def drive(run: Run, *kinds: type[Event], start_at: float = 1.0) -> Run:
    """``run`` after one event of each kind, a second apart."""
    for i, kind in enumerate(kinds):
        run = transition(run, make_event(kind, start_at + i))
    return run


def run_in(state: RunState, max_retries: int = 0) -> Run:
    """A run that reached ``state`` the shortest way."""
    return drive(new_run(max_retries), *PATHS[state])


#: a script that counts steps until stopped: on SIGTERM it writes its count into
#: GPULAB_CHECKPOINT_DIR, and it starts from the count it finds there ("resumed from <n>")
CHECKPOINTING_SCRIPT = """\
import os, signal, sys, time
mark = os.path.join(os.environ["GPULAB_CHECKPOINT_DIR"], "steps")
steps = int(open(mark).read()) if os.path.exists(mark) else 0
print("resumed from", steps, flush=True)
def save(*_):
    open(mark, "w").write(str(steps))
    sys.exit(143)
signal.signal(signal.SIGTERM, save)
while True:
    steps += 1
    time.sleep(0.05)
"""

# -- jobs through a real hub --------------------------------------------------------------------

INVENTORY = Config(
    GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"},
    GPUJobs={"admission_interval_seconds": 0.5},
)


def until(client: httpx.Client, path: str, *states: str, timeout: float = 60) -> dict[str, Any]:
    """The run at `path` (a job REST path) once it is in one of `states`; fails after `timeout`
    seconds with the run as it was."""
    deadline = time.monotonic() + timeout
    while True:
        run = client.get(path).json()
        if run.get("state") in states or time.monotonic() > deadline:
            assert run.get("state") in states, run
            return dict(run)
        time.sleep(0.3)


def user_client(hub: Hub, user: str) -> httpx.Client:
    """A client holding a token of `user`'s own (JupyterHub's default scopes for it)."""
    r = hub.api("POST", f"/users/{user}/tokens", json={"note": "job tests"})
    assert r.status_code == 201, r.text
    return httpx.Client(
        base_url=f"{hub.url}/hub/api/gpulab",
        headers={"Authorization": f"token {r.json()['token']}"},
        timeout=30,
    )


def put(hub: Hub, user: str, relative: str, text: str) -> None:
    """A file in the user's default server's home, hers (as if she had written it in the lab)."""
    account = hub.account(user)
    path = hub.home(user) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for p in (path, *[hub.home(user) / q for q in Path(relative).parents]):
        os.chown(p, account.pw_uid, account.pw_gid)
