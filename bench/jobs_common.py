"""What bench.jobs' phases share: the user, the gpulab side's REST client, the results they
fill, and the node-loss job's script (bench.jobs, bench.jobs_node_loss)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from gpulab.spawner.names import CHECKPOINT_DIR_ENV
from tests.harness.hub import Hub
from tests.harness.jobs import user_client

USER = "bench"
PROFILE = "gpu-quarter"
TERMINAL = ("succeeded", "failed", "canceled", "timed_out", "preempted")

#: the node-loss job: a script that checkpoints each step and says where it resumed from
CHECKPOINTING_SCRIPT = f"""\
import os, sys, time
steps = int(sys.argv[1])
ckpt = os.path.join(os.environ[{CHECKPOINT_DIR_ENV!r}], "step")
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
print(f"resumed from step {{start}}" if start else "fresh start", flush=True)
for step in range(start, steps):
    time.sleep(1)
    with open(ckpt + ".tmp", "w") as f:
        f.write(str(step + 1))
    os.replace(ckpt + ".tmp", ckpt)
    print(f"step {{step + 1}}", flush=True)
"""


class BenchError(RuntimeError):
    """A phase could not measure what it was asked to (the message says what happened)."""


class Gpulab:
    """The hub, its user and her token; calls that ride out a hub restart."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.client = user_client(hub, USER)
        self.jobs = f"/users/{USER}/jobs"

    def call(self, method: str, path: str, timeout: float = 120, **kw: Any) -> httpx.Response:
        """The response, retried while the hub (or its job service) is down or starting: only
        for calls that change nothing when refused (a 503 makes no run)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self.client.request(method, path, **kw)
                if r.status_code not in (502, 503) or time.monotonic() > deadline:
                    return r
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def submit(self, body: dict[str, Any]) -> tuple[int, float]:
        t0 = time.time()
        r = self.call("POST", self.jobs, json={"profile": PROFILE, "max_retries": 0, **body})
        if r.status_code != 201:
            raise BenchError(f"submit refused: {r.status_code} {r.text}")
        return int(r.json()["id"]), t0

    def run(self, run_id: int) -> dict[str, Any]:
        r = self.call("GET", f"{self.jobs}/{run_id}")
        if r.status_code != 200:
            raise BenchError(f"run {run_id}: {r.status_code} {r.text}")
        return dict(r.json())

    def wait(
        self,
        run_id: int,
        states: tuple[str, ...] = TERMINAL,
        timeout: float = 180,
        poll: float = 0.1,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if run["state"] in states:
                return run
            if time.monotonic() > deadline:
                raise BenchError(f"run {run_id} still {run['state']} after {timeout} s: {run}")
            time.sleep(poll)

    def log(self, run_id: int, attempt: int | None = None) -> str:
        """The stdout log of the run's (last) attempt, whole."""
        text, offset = "", 0
        while True:
            params: dict[str, Any] = {"offset": offset}
            if attempt is not None:
                params["attempt"] = attempt
            r = self.call("GET", f"{self.jobs}/{run_id}/logs", params=params)
            if r.status_code != 200:
                raise BenchError(f"log of run {run_id}: {r.status_code} {r.text}")
            body = r.json()
            text += body["data"]
            if body["next_offset"] == offset:
                return text
            offset = body["next_offset"]

    def free(self) -> int:
        r = self.call("GET", "/capacity")
        if r.status_code != 200:
            raise BenchError(f"capacity: {r.status_code} {r.text}")
        (profile,) = [p for p in r.json()["profiles"] if p["slug"] == PROFILE]
        return int(profile["free"])


@dataclass
class Results:
    running: dict[str, list[float]] = field(default_factory=lambda: {"anchor": [], "gpulab": []})
    done: dict[str, list[float]] = field(default_factory=lambda: {"anchor": [], "gpulab": []})
    cancel_answer: list[float] = field(default_factory=list)
    cancel_free: list[float] = field(default_factory=list)
    log_latency: list[float] = field(default_factory=list)
    log_lines_missing: int = 0
    durable_runs: int = 0
    lost: list[str] = field(default_factory=list)
    restarts: int = 0
    #: unfinished durable runs by state, summed over the moments just before each event
    states_at_events: dict[str, int] = field(default_factory=dict)
    culls: int = 0
    node_loss_s: float | None = None
    node_loss_note: str = ""
    #: attempts of the durable runs that failed before the job's code started (retried)
    platform_retries: int = 0
    cpu_hogs: int = 0
