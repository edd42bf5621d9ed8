"""GPU jobs: jupyter-scheduler's stock local execution beside gpulab's job service, in the same
run, and what only a hub-side job service is asked to do (issue 16's measurement contract).

- anchor: jupyter-scheduler 2.12 as it ships, a `jupyter server` with its default `Scheduler`
  (SQLite, each job a `multiprocessing` spawn child running nbconvert's ExecutePreprocessor),
  jobs created through its REST API (`POST /scheduler/jobs`) with the server's token;
- gpulab: a real hub on the embedded default (the shipped config, `GPUSimpleLocalSpawner`, the
  job service's shipped settings; simulated GPUs: a declared inventory of one A100, as the tests
  use), jobs through `/hub/api/gpulab/users/{user}/jobs` with the user's own token, through the
  proxy, on a 1/4-GPU profile, run as the user's account by papermill.

Phases, one after the other (each prints its row(s) of the one table):

1. submit: the same short notebook (three cells) submitted one job at a time, alternating
   anchor and gpulab (order flipped every round; one untimed warm-up each), `--jobs` each. Both
   are timed the same way: from the client's clock just before the POST to each side's own
   recorded start and end (jupyter-scheduler's `start_time`/`end_time`, gpulab's attempt
   `started_at`/`ended_at`; one machine, one clock), not from polling. "Running" is not the
   same point on both sides: jupyter-scheduler stamps it in its child process after that has
   imported nbconvert (~1 s after the spawn), gpulab when its job wrapper process exists (before
   it imports papermill), so submit-to-running favours gpulab; submit-to-done ends at the same
   point on both (the notebook executed and written) and is the headline ratio.
2. cancel-to-free: a notebook job waiting in a long cell (its kernel is up) is canceled
   (`DELETE`); timed until the hub's capacity endpoint (`GET /hub/api/gpulab/capacity`, the
   picker's numbers) shows the 1/4 GPU free again, `--cancels` times.
3. log latency: a notebook prints `tick <i> <time.time()>` lines; a client follows the run's
   Server-Sent Events stream through the proxy (`.../jobs/{run}/logs/stream`, reconnecting with
   `Last-Event-ID` as EventSource does) and takes each line's arrival minus its timestamp.
   The client authenticates with the user's token in a header (the CLI's way); a browser's
   EventSource sends her cookie and `_xsrf` instead, which changes no server-side work.
4. durability: `--restarts` hub restarts (SIGTERM to the hub and its proxy, start again) and
   `--culls` culls of the owner's server (started, then stopped through the REST API, which is
   what jupyterhub-idle-culler does), alternating, while notebook jobs run (topped up to
   `LIVE_RUNS` unfinished runs right before each event, so some are queued or just admitted when
   the hub goes down). `max_retries` is 0, so a run the hub failed is not hidden by a retry. A
   run is lost when it never ends, ends other than succeeded, its output file is not what it
   must be, its log misses a step, or it took more than one attempt of its own (attempts that
   failed before the job's code started, `platform_failure`, are the platform's retries and are
   counted apart). `--cpu-hog N` runs N busy-loop processes beside this phase (started before its
   first event, stopped after its last run ended), the load under which a kernel once took
   longer than nbclient's start-up wait.
5. node loss (dev cluster): `_node_loss_phase` stops the node under a running checkpointing
   script job (`gpulab dev-cluster stop-node`) and times from the node turning NotReady to the
   run printing, on another node, that it resumed from its checkpoint. It runs once the
   Kubernetes backend runs jobs (`GPUKubeSpawner.job_executor`) and the dev cluster's binaries
   are here; `--quick` measures it too (one node loss, as always) but cancels the run once it
   resumed instead of waiting for its end. Where it cannot run, the table and the line before
   the last say why and the last line says `node_loss_resume_s=n/a`.

    .venv/bin/python -m bench.jobs [--quick] [--jobs 30] [--cancels 20] [--log-runs 5]
                                   [--restarts 20] [--culls 20] [--no-node-loss]
                                   [--cpu-hog N]                                    (as root)

Last line: submit_ratio=<gpulab p50 / anchor p50, submit-to-done> cancel_free_p95_s=<x>
log_p95_s=<x> lost_runs=<n> node_loss_resume_s=<x or n/a>. Targets: lost_runs 0,
cancel_free_p95_s <= 10, log_p95_s <= 2, node_loss_resume_s <= 90.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import nbformat
from traitlets.config import Config

from bench._lastline import print_last_lines
from bench._spawning import percentile
from bench.jobs_common import TERMINAL, USER, BenchError, Gpulab, Results
from bench.jobs_node_loss import node_loss
from gpulab.spawner.names import JOB_OUTPUT_DIR_ENV
from tests.harness.hub import Hub
from tests.harness.jobs import put
from tests.harness.labserver import LabServer

#: simulated GPUs, as the job tests use; everything else is the shipped embedded default
GPULAB_OVERLAY = Config(GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"})
ANCHOR_EXTENSIONS = {"jupyter_scheduler": True, "jupyterlab_gpulab": False}
#: unfinished runs kept during the durability phase (4 would fill the user's 1-GPU quota)
LIVE_RUNS = 3
STEP_SECONDS = 0.5


def _notebook(*cells: str, parameters: str = "") -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    if parameters:
        nb.cells.append(nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


NOTEBOOKS = {
    # the short job both sides run
    "short.ipynb": _notebook(
        "total = sum(i * i for i in range(int(n)))",
        "print('total', total)",
        parameters="n = 100000",
    ),
    "wait.ipynb": _notebook("import time\nprint('started', flush=True)\ntime.sleep(3600)"),
    "ticks.ipynb": _notebook(
        "import time\n"
        "for i in range(int(lines)):\n"
        "    print(f'tick {i} {time.time():.6f}', flush=True)\n"
        "    time.sleep(float(interval))",
        parameters="lines = 40\ninterval = 0.1",
    ),
    "durable.ipynb": _notebook(
        "import os, time\n"
        "for step in range(int(steps)):\n"
        "    print(f'step {step}', flush=True)\n"
        f"    time.sleep({STEP_SECONDS})",
        f"out = os.path.join(os.environ[{JOB_OUTPUT_DIR_ENV!r}], 'result.txt')\n"
        "with open(out, 'w') as f:\n"
        "    f.write(f'{tag} {int(steps)}')",
        parameters="steps = 4\ntag = 'x'",
    ),
}

# -- the two sides ---------------------------------------------------------------------------------


class Anchor:
    """jupyter-scheduler's stock local execution in a `jupyter server` of its own."""

    def __init__(self, lab: LabServer) -> None:
        self.lab = lab

    def run_once(self, notebook: str, name: str, timeout: float = 180) -> tuple[float, float]:
        """(submit-to-running, submit-to-done) of one job, from the scheduler's own records."""
        body = {
            "input_uri": notebook,
            "runtime_environment_name": "default",
            "name": name,
            "output_formats": ["ipynb"],
        }
        t0 = time.time()
        r = self.lab.client.post("/scheduler/jobs", json=body)
        if r.status_code != 200:
            raise BenchError(f"jupyter-scheduler refused a job: {r.status_code} {r.text}")
        job_id = r.json()["job_id"]
        deadline = time.monotonic() + timeout
        while True:
            job = self.lab.client.get(f"/scheduler/jobs/{job_id}").json()
            # a new job is STOPPED (the ORM's default) until its child process says it runs
            if job["status"] in ("COMPLETED", "FAILED") or (
                job["status"] == "STOPPED" and job["start_time"]
            ):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"jupyter-scheduler job {job_id} still {job['status']}")
            time.sleep(0.1)
        if job["status"] != "COMPLETED":
            raise BenchError(f"jupyter-scheduler job {job_id}: {job['status']} {job}")
        return job["start_time"] / 1000 - t0, job["end_time"] / 1000 - t0


def gpulab_run_once(side: Gpulab, notebook: str, name: str) -> tuple[float, float]:
    run_id, t0 = side.submit({"name": name, "kind": "notebook", "path": notebook})
    run = side.wait(run_id)
    if run["state"] != "succeeded":
        raise BenchError(f"gpulab run {run_id}: {run['state']} {run['reason']}")
    first, last = run["attempts"][0], run["attempts"][-1]
    return first["started_at"] - t0, last["ended_at"] - t0


# -- phases ----------------------------------------------------------------------------------------


def submit_phase(anchor: Anchor, gpulab: Gpulab, jobs: int, out: Results) -> None:
    sides: dict[str, Callable[[str], tuple[float, float]]] = {
        "anchor": lambda name: anchor.run_once("short.ipynb", name),
        "gpulab": lambda name: gpulab_run_once(gpulab, "short.ipynb", name),
    }
    for name, once in sides.items():  # warm-up: first kernel, first imports
        once(f"warm-{name}")
    for i in range(jobs):
        for name in list(sides) if i % 2 == 0 else reversed(list(sides)):
            running, done = sides[name](f"short-{i}")
            out.running[name].append(running)
            out.done[name].append(done)


def cancel_phase(gpulab: Gpulab, cancels: int, out: Results) -> None:
    baseline = gpulab.free()
    for i in range(cancels):
        run_id, _ = gpulab.submit({"name": f"cancel-{i}", "kind": "notebook", "path": "wait.ipynb"})
        gpulab.wait(run_id, ("running", *TERMINAL))
        deadline = time.monotonic() + 120
        while "started" not in gpulab.log(run_id):  # the kernel is up, in its long cell
            if time.monotonic() > deadline:
                raise BenchError(f"run {run_id} never printed 'started': {gpulab.run(run_id)}")
            time.sleep(0.1)
        held = gpulab.free()
        if held != baseline - 1:
            raise BenchError(
                f"capacity shows {held} free with run {run_id} holding a share of {baseline}"
            )
        t0 = time.perf_counter()
        r = gpulab.call("DELETE", f"{gpulab.jobs}/{run_id}")
        answered = time.perf_counter() - t0
        if r.status_code != 200 or r.json()["state"] != "canceled":
            raise BenchError(f"cancel of run {run_id}: {r.status_code} {r.text}")
        while gpulab.free() != baseline:
            if time.perf_counter() - t0 > 120:
                raise BenchError(f"the share of run {run_id} not free 120 s after its cancel")
            time.sleep(0.02)
        out.cancel_answer.append(answered)
        out.cancel_free.append(time.perf_counter() - t0)


def sse_pieces(
    client: httpx.Client, path: str, give_up_after: float = 300
) -> Iterator[tuple[float, str]]:
    """(arrival time, text) of every log piece of a run's SSE stream until its `end` event,
    reconnecting with Last-Event-ID when the server ends a stream, as EventSource does."""
    last_id, deadline = "", time.monotonic() + give_up_after
    while time.monotonic() < deadline:
        headers = {"Last-Event-ID": last_id} if last_id else {}
        with client.stream("GET", path, headers=headers, timeout=60) as response:
            if response.status_code != 200:
                raise BenchError(f"log stream: {response.status_code} {response.read()!r}")
            event, data = "message", ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("id: "):
                    last_id = line.removeprefix("id: ")
                elif line.startswith("data: "):
                    data = line.removeprefix("data: ")
                elif line == "" and data:
                    if event == "end":
                        return
                    yield time.time(), json.loads(data)["data"]
                    event, data = "message", ""
    raise BenchError(f"log stream {path} did not end in {give_up_after} s")


def tick_latencies(pieces: Iterator[tuple[float, str]]) -> dict[int, float]:
    """Tick number -> seconds from its timestamp to the arrival of the piece that completed its
    line (pieces may cut lines anywhere)."""
    latencies: dict[int, float] = {}
    pending = ""
    for arrived, text in pieces:
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "tick":
                latencies[int(parts[1])] = arrived - float(parts[2])
    return latencies


def log_phase(gpulab: Gpulab, runs: int, lines: int, out: Results) -> None:
    for i in range(runs):
        run_id, _ = gpulab.submit(
            {
                "name": f"ticks-{i}",
                "kind": "notebook",
                "path": "ticks.ipynb",
                "parameters": {"lines": lines, "interval": 0.1},
            }
        )
        got = tick_latencies(sse_pieces(gpulab.client, f"{gpulab.jobs}/{run_id}/logs/stream"))
        out.log_latency += got.values()
        out.log_lines_missing += lines - len(got)
        run = gpulab.wait(run_id)
        if run["state"] != "succeeded":
            raise BenchError(f"ticks run {run_id}: {run['state']} {run['reason']}")


def durability_phase(gpulab: Gpulab, restarts: int, culls: int, steps: int, out: Results) -> None:
    hub = gpulab.hub
    submitted: dict[int, str] = {}  # run id -> its tag

    def top_up() -> None:
        unfinished = [rid for rid in submitted if gpulab.run(rid)["state"] not in TERMINAL]
        for _ in range(LIVE_RUNS - len(unfinished)):
            tag = f"durable-{len(submitted)}"
            run_id, _ = gpulab.submit(
                {
                    "name": tag,
                    "kind": "notebook",
                    "path": "durable.ipynb",
                    "parameters": {"steps": steps, "tag": tag},
                }
            )
            submitted[run_id] = tag

    order = []  # alternating while both last
    r = c = 0
    while r < restarts or c < culls:
        if r < restarts:
            order.append("restart")
            r += 1
        if c < culls:
            order.append("cull")
            c += 1
    for event in order:
        top_up()
        listed = gpulab.call("GET", gpulab.jobs).json()["runs"]
        for run in listed:
            if run["id"] in submitted and run["state"] not in TERMINAL:
                out.states_at_events[run["state"]] = out.states_at_events.get(run["state"], 0) + 1
        if event == "restart":
            hub.stop_hub()
            hub.start()
            out.restarts += 1
        else:
            gpulab.call("GET", "/capacity")  # the hub answers again (after a restart)
            hub.start_server(USER, profile="cpu")
            hub.stop_server(USER)  # what jupyterhub-idle-culler does: DELETE the server
            out.culls += 1
    out.durable_runs = len(submitted)
    deadline = time.monotonic() + steps * STEP_SECONDS * 3 + 180
    for run_id, tag in submitted.items():
        try:
            run = gpulab.wait(run_id, timeout=max(1.0, deadline - time.monotonic()), poll=0.5)
        except BenchError as e:
            out.lost.append(f"run {run_id}: never ended ({e})")
            continue
        if run["state"] != "succeeded":
            err = gpulab.call("GET", f"{gpulab.jobs}/{run_id}/logs", params={"stream": "stderr"})
            tail = err.json().get("data", "")[-400:] if err.status_code == 200 else err.text
            out.lost.append(
                f"run {run_id}: {run['state']} ({run['reason']}); attempts {run['attempts']}; "
                f"stderr ends {tail!r}; the hub's log on it: "
                f"{[ln for ln in hub.log().splitlines() if f'run {run_id}' in ln][:10]}"
            )
            continue
        result = hub.home(USER) / "gpulab-jobs" / tag / f"run-{run_id}" / "result.txt"
        text = result.read_text() if result.is_file() else None
        if text != f"{tag} {steps}":
            out.lost.append(f"run {run_id}: succeeded but its result is {text!r}")
            continue
        log = gpulab.log(run_id)
        missing = [s for s in range(steps) if f"step {s}\n" not in log]
        platform = [a for a in run["attempts"] if a.get("platform_failure")]
        out.platform_retries += len(platform)
        own = len(run["attempts"]) - len(platform)
        if missing or own != 1:
            out.lost.append(
                f"run {run_id}: {own} attempts of its own ({len(platform)} failed before its code "
                f"started: {[a['reason'] for a in platform]}), log misses steps {missing[:5]}"
            )


# -- the table ---------------------------------------------------------------------------------------


def _stats(values: list[float]) -> str:
    if not values:
        return f"{0:>4} {'':>8} {'':>8} {'':>8}"
    return (
        f"{len(values):>4} {statistics.median(values):>8.3f} {percentile(values, 0.95):>8.3f} "
        f"{max(values):>8.3f}"
    )


def print_table(out: Results) -> float:
    """The one table; returns the submit ratio (p50 submit-to-done, gpulab / anchor)."""
    w = 52
    print(f"{'measure':<{w}} {'n':>4} {'p50 s':>8} {'p95 s':>8} {'max s':>8}  note")
    labels = {
        "anchor": f"jupyter-scheduler {version('jupyter_scheduler')} (stock)",
        "gpulab": "gpulab (hub job service)",
    }
    ratios = {}
    for what, times in (("submit-to-running", out.running), ("submit-to-done", out.done)):
        for side, label in labels.items():
            print(f"{what + ', ' + label:<{w}} {_stats(times[side])}")
        p50 = statistics.median(times["gpulab"]) / statistics.median(times["anchor"])
        p95 = percentile(times["gpulab"], 0.95) / percentile(times["anchor"], 0.95)
        ratios[what] = p50
        print(f"{what + ', ratio gpulab/anchor':<{w}} {'':>4} {p50:>8.3f} {p95:>8.3f}")
    print(f"{'cancel: DELETE answered':<{w}} {_stats(out.cancel_answer)}")
    print(
        f"{'cancel-to-free (capacity shows the share)':<{w}} {_stats(out.cancel_free)}"
        "  target p95 <= 10 s"
    )
    print(
        f"{'log line to client (SSE through the proxy)':<{w}} {_stats(out.log_latency)}"
        f"  target p95 <= 2 s; {out.log_lines_missing} lines missing"
    )
    hogs = f", {out.cpu_hogs} CPU hogs beside it" if out.cpu_hogs else ""
    print(
        f"{'runs lost through restarts and culls':<{w}} {len(out.lost):>4} {'':>8} {'':>8} "
        f"{'':>8}  {out.durable_runs} runs, {out.restarts} hub restarts, {out.culls} culls"
        f"{hogs}; target 0"
    )
    print(
        f"    attempts that failed before the job's code started (retried, not lost): "
        f"{out.platform_retries}"
    )
    hit = ", ".join(f"{n} {state}" for state, n in sorted(out.states_at_events.items()))
    print(f"    unfinished runs at the events (summed): {hit or 'none'}")
    for line in out.lost:
        print(f"    lost: {line}")
    resume = [out.node_loss_s] if out.node_loss_s is not None else []
    print(
        f"{'node loss: NotReady to resumed on another node':<{w}} {_stats(resume)}"
        f"  {out.node_loss_note}; target <= 90 s"
    )
    return ratios["submit-to-done"]


def _fmt(value: float | None) -> str | None:
    """The last line's value (None: n/a, whose reason the line before gives)."""
    return None if value is None or math.isnan(value) else f"{value:.3f}"


def _p95(values: list[float]) -> float | None:
    return percentile(values, 0.95) if values else None


# -- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    parser.add_argument("--jobs", type=int, default=None, help="short jobs per side (30)")
    parser.add_argument("--cancels", type=int, default=None, help="cancels timed (20)")
    parser.add_argument("--log-runs", type=int, default=None, help="log-latency runs (5)")
    parser.add_argument("--restarts", type=int, default=None, help="hub restarts (20)")
    parser.add_argument("--culls", type=int, default=None, help="server culls (20)")
    parser.add_argument(
        "--no-node-loss", action="store_true", help="skip the dev-cluster node-loss phase"
    )
    parser.add_argument(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="N",
        help="N busy-loop processes beside the lost-runs phase (the machine under load)",
    )
    args = parser.parse_args(argv)
    if args.cpu_hog < 0:
        parser.error(f"--cpu-hog: a number of processes from 0, not {args.cpu_hog}")
    q = args.quick
    jobs = args.jobs if args.jobs is not None else (3 if q else 30)
    cancels = args.cancels if args.cancels is not None else (3 if q else 20)
    log_runs = args.log_runs if args.log_runs is not None else (1 if q else 5)
    restarts = args.restarts if args.restarts is not None else (2 if q else 20)
    culls = args.culls if args.culls is not None else (2 if q else 20)
    lines = 20 if q else 40
    steps = 12 if q else 40  # durable runs: STEP_SECONDS each, so several events per run
    if os.geteuid() != 0:
        print("bench.jobs: gpulab runs jobs as each user's own account; run it as root")
        return 2
    skip_node_loss = "--no-node-loss" if args.no_node_loss else None

    out = Results()
    load0 = os.getloadavg()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-jobs-") as tmp:
        root = Path(tmp)
        lab = LabServer(root / "anchor", extensions=ANCHOR_EXTENSIONS)
        hub = Hub(root / "gpulab", GPULAB_OVERLAY)
        try:
            for name, nb in NOTEBOOKS.items():
                nbformat.write(nb, lab.home / name)
            lab.start()
            hub.start()
            hub.create_user(USER)
            hub.start_server(USER, profile="cpu")  # makes her account and home
            for name, nb in NOTEBOOKS.items():
                put(hub, USER, name, nbformat.writes(nb))
            hub.stop_server(USER)  # jobs need no server
            gpulab = Gpulab(hub)
            submit_phase(Anchor(lab), gpulab, jobs, out)
            lab.stop()  # the anchor's part is done: leave the machine to the hub
            cancel_phase(gpulab, cancels, out)
            log_phase(gpulab, log_runs, lines, out)
            with cpu_hogs(args.cpu_hog):
                out.cpu_hogs = args.cpu_hog
                durability_phase(gpulab, restarts, culls, steps, out)
        except BaseException:
            print(hub.log()[-3000:], file=sys.stderr)
            raise
        finally:
            lab.stop()
            hub.close()
            hub.cleanup()
        node_loss(root, out, skip_node_loss, finish=not q)

    ratio = print_table(out)
    load1 = os.getloadavg()
    print(
        f"{os.cpu_count()} CPUs; 1-min load {load0[0]:.2f} at the start, {load1[0]:.2f} at the "
        f"end; {time.monotonic() - t_start:.0f} s in all"
    )
    print_last_lines(
        {
            "submit_ratio": f"{ratio:.3f}",
            "cancel_free_p95_s": _fmt(_p95(out.cancel_free)),
            "log_p95_s": _fmt(_p95(out.log_latency)),
            "lost_runs": str(len(out.lost)),
            "node_loss_resume_s": _fmt(out.node_loss_s),
        },
        {"node_loss_resume_s": out.node_loss_note},
    )
    return 0


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes that each keep one CPU busy while the block runs, stopped after."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


if __name__ == "__main__":
    raise SystemExit(main())
