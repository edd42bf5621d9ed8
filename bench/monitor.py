"""GPU panels vs the server's event loop: gpulab's monitor against jupyterlab-nvdashboard.

Three real `jupyter server`s run side by side over the same labelled fake pynvml
(tests/harness/fake_nvml): 8 fake H100s whose every NVML call costs what bench/data/
nvml_call_costs.json says, with a citation or a labelled assumption for each figure. Both
monitors run their own, unmodified NVML code over it:

- anchor: jupyterlab-nvdashboard (PyPI), its real websocket handlers. Each panel (widget) has its
  own socket with its own timer at the rate the panel asks, and each tick calls NVML for every
  GPU on the event loop. Two of its panels are measured: "GPU Utilization" + "GPU Memory" side by
  side (two sockets per panel; the figures gpulab's panel shows too; the headline anchor), and
  "GPU Resources" (utilisation, memory and PCIe throughput, whose NVML call waits out a 20 ms
  counter window).
- gpulab: one sampler thread reads every GPU once a second whatever the panels ask (utilisation,
  memory, process list, temperature, power), and the loop only forwards the serialised sample.
- floor: gpulab's server with monitoring off: the machine's own scheduling noise in the same run.

1, 10 and 50 panels ask for 1 Hz, then 20 Hz. The cases are interleaved: every round visits each
case in a shuffled order and, within a case, each monitor in turn, so drift in the shared
machine's load falls on all of them alike. Every server measures its own loop lag with the same
probe (bench/_lag_probe.py: a 10 ms timer's lateness); the table gives the median, p95, p99 and
max over all rounds, the pushes each panel got per second, and the server process's whole CPU
(user + system time of every thread, from /proc, over the measured window).

    .venv/bin/python -m bench.monitor [--quick] [--seconds S] [--rounds N]

Last line: p99_lag_ms=<gpulab, 50 panels asking 20 Hz> sampler_cpu_pct=<gpulab's server minus the
floor's, whole-process CPU, one panel at 1 Hz, % of one core: the cost of sampling 8 GPUs at 1 Hz
and pushing it> anchor_p99_lag_ms=<nvdashboard's utilisation + memory panel, 50 panels at 20 Hz>.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from gpulab.spawner.names import GPU_UUIDS_ENV
from jupyterlab_gpulab.lag import percentile
from tests.harness import fake_nvml
from tests.harness.labserver import EXTENSION_SRC, REPO, LabServer

GPUS = 8
CLIENTS = (1, 10, 50)
RATES = (1.0, 20.0)
COSTS = Path(__file__).parent / "data" / "nvml_call_costs.json"
TICK = os.sysconf("SC_CLK_TCK")
PROBE = "bench/lag"

GPULAB_CONFIG = """
c.GPUMonitor.period_seconds = 1.0
c.GPUMonitor.default_rules = []
c.GPUMonitor.max_clients = 1000
"""


def fake_machine() -> dict[str, object]:
    """8 NVLinked H100s, each with one process running (pids no process here has)."""
    bus = [f"00000000:{0x18 + 0x10 * i:02x}:00.0" for i in range(GPUS)]
    return {
        "gpus": [
            {
                "uuid": f"GPU-fa4e0000-0000-4000-8000-{i:012d}",
                "name": "FAKE NVIDIA H100 80GB HBM3",
                "memory_mib": 81559,
                "memory_used_mib": 20000 + 1000 * i,
                "bus_id": bus[i],
                "nvlink_to": [b for b in bus if b != bus[i]],
                "mig_capable": True,
                "utilization": 40 + 5 * i,
                "temperature": 50,
                "power_mw": 400_000,
                "pcie_gen": 5,
                "processes": [{"pid": 3_999_000 + i, "memory_mib": 20000}],
            }
            for i in range(GPUS)
        ]
    }


@dataclass(frozen=True)
class Monitor:
    """One kind of panel: which server it talks to and how."""

    label: str
    server: str
    paths: tuple[str, ...]  # one websocket per path, per panel
    is_push: Callable[[str], bool]
    ws_query: bool = False  # gpulab takes the rate in the URL, nvdashboard in a message


def _gpulab_push(msg: str) -> bool:
    return msg.startswith('{"type": "sample"')


def _nvdashboard_push(msg: str) -> bool:
    return not msg.startswith('{"status"')


MONITORS = {
    "floor": Monitor(
        "jupyter server, no GPU reads", "floor", ("gpulab/monitor/ws",), _gpulab_push, True
    ),
    "nvd_util_mem": Monitor(
        "nvdashboard Utilization+Memory",
        "nvdashboard",
        ("nvdashboard/gpu_utilization", "nvdashboard/gpu_usage"),
        _nvdashboard_push,
    ),
    "nvd_resources": Monitor(
        "nvdashboard GPU Resources", "nvdashboard", ("nvdashboard/gpu_resource",), _nvdashboard_push
    ),
    "gpulab": Monitor(
        "gpulab (sampler thread)", "gpulab", ("gpulab/monitor/ws",), _gpulab_push, True
    ),
}
ANCHOR = "nvd_util_mem"


@dataclass
class Tally:
    """One monitor in one case, summed over the rounds."""

    lags_ms: list[float] = field(default_factory=list)
    pushes_per_panel: float = 0.0
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0


def process_cpu_seconds(pid: int) -> float:
    """User + system time of the whole process (every thread), as the kernel counts it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start_servers(root: Path) -> dict[str, LabServer]:
    machine_env = fake_nvml.subprocess_env(
        fake_machine(), root / "machine.json", pythonpath=f"{EXTENSION_SRC}:{REPO}", costs=COSTS
    )
    uuids = ",".join(g["uuid"] for g in fake_machine()["gpus"])  # type: ignore[index]
    specs = {
        "floor": (
            {"jupyterlab_gpulab": True, "jupyterlab_nvdashboard": False},
            {"GPULAB_MONITOR_SOURCE": "none"},
            'c.GPUMonitor.source = "none"',
        ),
        "nvdashboard": ({"jupyterlab_gpulab": False, "jupyterlab_nvdashboard": True}, {}, ""),
        "gpulab": (
            {"jupyterlab_gpulab": True, "jupyterlab_nvdashboard": False},
            {"GPULAB_MONITOR_SOURCE": "nvml", GPU_UUIDS_ENV: uuids},
            'c.GPUMonitor.source = "nvml"',
        ),
    }
    servers: dict[str, LabServer] = {}
    try:
        for key, (extensions, env, config) in specs.items():
            lab = LabServer(
                root / key,
                env={**machine_env, **env},
                config=GPULAB_CONFIG + config,
                extensions={**extensions, "bench._lag_probe": True},
            )
            lab.start()
            servers[key] = lab
        # both monitors see the fake's 8 GPUs through their own NVML code
        devices = servers["gpulab"].get("devices").json()["devices"]
        assert len(devices) == GPUS and all("FAKE" in d["name"] for d in devices), devices
        status = servers["nvdashboard"].client.get("/nvdashboard/accelerators/check").json()
        assert status["ngpus"] == GPUS, status
    except BaseException:
        for lab in servers.values():
            lab.stop()
        raise
    return servers


async def _reader(
    ws: WebSocketClientConnection, is_push: Callable[[str], bool], counts: list[int], i: int
) -> None:
    while True:
        msg = await ws.read_message()
        if msg is None:
            return
        if isinstance(msg, str) and is_push(msg):
            counts[i] += 1


async def run_window(
    lab: LabServer, monitor: Monitor, clients: int, rate: float, warmup: float, seconds: float
) -> tuple[list[float], float, float, float]:
    """(lags in ms, pushes per panel per second, CPU seconds, wall seconds) of one window."""

    async def connect(path: str) -> WebSocketClientConnection:
        url = f"{lab.ws_url}/{path}" + (f"?rate_hz={rate:g}" if monitor.ws_query else "")
        request = HTTPRequest(url, headers=lab.headers, connect_timeout=120, request_timeout=120)
        ws = await websocket_connect(request)
        if not monitor.ws_query:  # nvdashboard's panels send their update period in ms
            await ws.write_message(json.dumps({"updateFrequency": 1000 / rate, "isPaused": False}))
        return ws

    # all at once: a saturated server would otherwise take minutes to accept them one by one
    sockets = await asyncio.gather(*(connect(p) for _ in range(clients) for p in monitor.paths))
    counts = [0] * len(sockets)
    readers = [
        asyncio.create_task(_reader(ws, monitor.is_push, counts, i)) for i, ws in enumerate(sockets)
    ]
    async with httpx.AsyncClient(base_url=lab.url, headers=lab.headers, timeout=120) as http:
        try:
            await asyncio.sleep(warmup)
            await http.get(f"/{PROBE}", params={"reset": "1"})
            counts[:] = [0] * len(sockets)
            cpu0, t0 = process_cpu_seconds(lab.proc.pid), time.perf_counter()
            await asyncio.sleep(seconds)
            lags = (await http.get(f"/{PROBE}")).json()["lags_ms"]
            wall = time.perf_counter() - t0
            cpu = process_cpu_seconds(lab.proc.pid) - cpu0
            pushes = sum(counts) / len(counts) / wall
        finally:
            for ws in sockets:
                ws.close()
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        # let the server drain what the closed panels left scheduled
        await asyncio.sleep(warmup)
        await http.get(f"/{PROBE}", params={"reset": "1"})
    return lags, pushes, cpu, wall


def cases() -> list[tuple[str, int, float]]:
    out = [("floor", 1, 1.0)]
    for rate in RATES:
        for clients in CLIENTS:
            out += [(m, clients, rate) for m in MONITORS if m != "floor"]
    return out


async def bench(
    servers: dict[str, LabServer], rounds: int, warmup: float, seconds: float, seed: int = 0
) -> dict[tuple[str, int, float], Tally]:
    rng = random.Random(seed)
    tallies: dict[tuple[str, int, float], Tally] = {c: Tally() for c in cases()}
    per_round = seconds / rounds
    groups = sorted({(c, r) for _, c, r in tallies})
    for round_no in range(rounds):
        rng.shuffle(groups)
        for clients, rate in groups:
            keys = [k for k in tallies if k[1:] == (clients, rate)]
            # rotate who goes first in this case, round by round
            keys = keys[round_no % len(keys) :] + keys[: round_no % len(keys)]
            for key in keys:
                monitor = MONITORS[key[0]]
                lags, pushes, cpu, wall = await run_window(
                    servers[monitor.server], monitor, clients, rate, warmup, per_round
                )
                t = tallies[key]
                t.lags_ms += lags
                t.pushes_per_panel += pushes * wall
                t.cpu_seconds += cpu
                t.wall_seconds += wall
    return tallies


@dataclass
class Row:
    key: str
    clients: int
    rate_hz: float
    got_hz: float
    lag_n: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    cpu_pct: float


def rows_of(tallies: dict[tuple[str, int, float], Tally]) -> list[Row]:
    rows = []
    for (key, clients, rate), t in tallies.items():
        lags = [x / 1000 for x in t.lags_ms]
        rows.append(
            Row(
                key,
                clients,
                rate,
                t.pushes_per_panel / t.wall_seconds,
                len(lags),
                percentile(lags, 0.5) * 1000,
                percentile(lags, 0.95) * 1000,
                percentile(lags, 0.99) * 1000,
                max(lags, default=0.0) * 1000,
                100 * t.cpu_seconds / t.wall_seconds,
            )
        )
    order = list(MONITORS)
    rows.sort(key=lambda r: (r.key != "floor", r.rate_hz, r.clients, order.index(r.key)))
    return rows


def print_table(rows: list[Row]) -> None:
    width = max(len(m.label) for m in MONITORS.values()) + 2
    anchor = {(r.clients, r.rate_hz): r for r in rows if r.key == ANCHOR}
    print(
        f"{'monitor':<{width}} {'panels':>6} {'asks Hz':>7} {'got Hz':>6} {'lag n':>6} "
        f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8} {'cpu %':>6} {'p99/anchor':>10}"
    )
    for r in rows:
        a = anchor.get((r.clients, r.rate_hz))
        ratio = f"{r.p99_ms / a.p99_ms:>10.4f}" if r.key == "gpulab" and a and a.p99_ms else ""
        print(
            f"{MONITORS[r.key].label:<{width}} {r.clients:>6} {r.rate_hz:>7g} {r.got_hz:>6.2f} "
            f"{r.lag_n:>6} {r.p50_ms:>8.2f} {r.p95_ms:>8.2f} {r.p99_ms:>8.2f} {r.max_ms:>8.1f} "
            f"{r.cpu_pct:>6.1f} {ratio}".rstrip()
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 1.5 s per case")
    parser.add_argument(
        "--seconds", type=float, default=None, help="measured seconds per case (default 15)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 1)")
    args = parser.parse_args(argv)
    seconds = args.seconds or (1.5 if args.quick else 15.0)
    rounds = args.rounds or (1 if args.quick else 3)
    warmup = 0.3 if args.quick else 2.0

    with tempfile.TemporaryDirectory(prefix="gpulab-bench-monitor-") as tmp:
        servers = start_servers(Path(tmp))
        try:
            tallies = asyncio.run(bench(servers, rounds, warmup, seconds))
        finally:
            for lab in servers.values():
                lab.stop()
    rows = rows_of(tallies)
    print_table(rows)
    by = {(r.key, r.clients, r.rate_hz): r for r in rows}
    ours, anchor = by[("gpulab", 50, 20.0)], by[(ANCHOR, 50, 20.0)]
    sampler = by[("gpulab", 1, 1.0)].cpu_pct - by[("floor", 1, 1.0)].cpu_pct
    print(
        f"gpulab's server minus the floor's, one panel at 1 Hz: {sampler:.3f} % of one core "
        f"(whole-process CPU; {GPUS} GPUs sampled at 1 Hz, NVML costs from {COSTS.name})"
    )
    print(
        f"p99_lag_ms={ours.p99_ms:.3f} sampler_cpu_pct={sampler:.3f} "
        f"anchor_p99_lag_ms={anchor.p99_ms:.3f}"
    )
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
