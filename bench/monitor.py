"""GPU panels vs the server's event loop: gpulab's monitor against an nvdashboard-style handler.

Both run inside a real `jupyter server` with 8 simulated GPUs whose NVML calls cost what real
ones do (2.5 us utilisation, 12 us memory, 4.5 ms process list per GPU). 1, 10 and 50 panel
websockets ask for 1 Hz, then 20 Hz. The servers measure their own loop lag (a 10 ms timer's
lateness); the table gives its median, p99 and max, the pushes each panel got per second, the
server process's CPU, and gpulab's p99 as a ratio of the anchor's in the same case. A first row
gives the floor: the same server reading no GPU (the machine's own scheduling noise).

- anchor, "nvdashboard-style": every panel gets its own timer at the rate it asks, and each tick
  reads every GPU on the event loop (bench/_naive_monitor.py).
- gpulab: one sampler thread reads every GPU once a second whatever the panels ask; the loop only
  forwards the serialised sample.

The simulated process list is a 4.5 ms sleep, not a spin: a real pynvml call is a ctypes call that
releases the GIL while the driver works, so it blocks the thread that makes it (the loop, for the
anchor) but not the interpreter. The microsecond calls spin, holding the GIL as the Python around
a real call would.

    .venv/bin/python -m bench.monitor [--quick] [--seconds S]

Last line: p99_lag_ms=<gpulab, 50 panels asking 20 Hz> sampler_cpu_pct=<gpulab's sampler thread,
8 GPUs at 1 Hz, % of one core>.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from tests.harness.labserver import LabServer

GPUS = 8
CLIENTS = (1, 10, 50)
RATES = (1.0, 20.0)
TICK = os.sysconf("SC_CLK_TCK")

SERVERS = {
    "floor": ("jupyter server, no GPU reads", {"jupyterlab_gpulab": True}, "gpulab/monitor"),
    "anchor": (
        "nvdashboard-style (NVML on loop)",
        {"bench._naive_monitor": True},
        "naive/monitor",
    ),
    "gpulab": ("gpulab (sampler thread)", {"jupyterlab_gpulab": True}, "gpulab/monitor"),
}
GPULAB_CONFIG = f"""
c.GPUMonitor.source = "simulated"
c.GPUMonitor.simulated_device_count = {GPUS}
c.GPUMonitor.period_seconds = 1.0
c.GPUMonitor.measure_loop_lag = True
c.GPUMonitor.default_rules = []
"""


@dataclass
class Row:
    server: str
    clients: int
    rate_hz: float
    got_hz: float
    lag_n: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu_pct: float


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


async def _reader(ws: WebSocketClientConnection, counts: list[int], i: int) -> None:
    while True:
        msg = await ws.read_message()
        if msg is None:
            return
        if isinstance(msg, str) and msg.startswith('{"type": "sample"'):
            counts[i] += 1


async def run_case(
    lab: LabServer, key: str, prefix: str, clients: int, rate: float, warmup: float, seconds: float
) -> Row:
    url = f"{lab.ws_url}/{prefix}/ws?rate_hz={rate:g}"

    async def connect() -> WebSocketClientConnection:
        request = HTTPRequest(url, headers=lab.headers, connect_timeout=120, request_timeout=120)
        return await websocket_connect(request)

    # all at once: a saturated anchor would otherwise take minutes to accept them one by one
    sockets = await asyncio.gather(*(connect() for _ in range(clients)))
    counts = [0] * clients
    readers = [asyncio.create_task(_reader(ws, counts, i)) for i, ws in enumerate(sockets)]
    async with httpx.AsyncClient(base_url=lab.url, headers=lab.headers, timeout=120) as http:
        try:
            await asyncio.sleep(warmup)
            await http.get(f"/{prefix}/lag", params={"reset": "1"})
            counts[:] = [0] * clients
            cpu0, t0 = process_cpu_seconds(lab.proc.pid), time.perf_counter()
            await asyncio.sleep(seconds)
            lag = (await http.get(f"/{prefix}/lag")).json()
            elapsed = time.perf_counter() - t0
            cpu = process_cpu_seconds(lab.proc.pid) - cpu0
            got = statistics.mean(counts) / elapsed
        finally:
            for ws in sockets:
                ws.close()
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        # let the server drain what the closed panels left scheduled
        await http.get(f"/{prefix}/lag", params={"reset": "1"})
        await asyncio.sleep(warmup)
    return Row(
        key,
        clients,
        rate,
        got,
        int(lag["count"]),
        lag["p50_ms"],
        lag["p99_ms"],
        lag["max_ms"],
        100 * cpu / elapsed,
    )


def sampler_cpu(lab: LabServer) -> tuple[float, float, int]:
    stats = lab.get("stats").json()
    return stats["sampler_cpu_seconds"], stats["sampler_wall_seconds"], stats["samples_taken"]


async def bench_server(
    root: Path, key: str, warmup: float, seconds: float
) -> tuple[list[Row], float | None]:
    _label, extensions, prefix = SERVERS[key]
    lab = LabServer(
        root / key,
        # the floor: the same server reading no GPU, the machine's own noise in the same run
        env={"GPULAB_MONITOR_SOURCE": "none" if key == "floor" else "simulated"},
        config=GPULAB_CONFIG,
        extensions=extensions,
    )
    lab.start()
    rows = []
    try:
        if key == "gpulab":
            assert len(lab.get("devices").json()["devices"]) == GPUS
            before = sampler_cpu(lab)
        cases = [(1, 1.0)] if key == "floor" else [(c, r) for r in RATES for c in CLIENTS]
        for clients, rate in cases:
            rows.append(await run_case(lab, key, prefix, clients, rate, warmup, seconds))
        cpu_pct = None
        if key == "gpulab":
            after = sampler_cpu(lab)
            cpu_pct = 100 * (after[0] - before[0]) / (after[1] - before[1])
    finally:
        lab.stop()
    return rows, cpu_pct


def print_table(rows: list[Row]) -> None:
    labels = {k: v[0] for k, v in SERVERS.items()}
    width = max(len(v) for v in labels.values()) + 2
    anchor = {(r.clients, r.rate_hz): r for r in rows if r.server == "anchor"}
    print(
        f"{'monitor':<{width}} {'panels':>6} {'asks Hz':>7} {'got Hz':>6} {'lag n':>6} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'cpu %':>6} {'p99/anchor':>10}"
    )
    order = {"floor": 0, "anchor": 1, "gpulab": 2}
    for r in sorted(
        rows, key=lambda r: (r.server != "floor", r.rate_hz, r.clients, order[r.server])
    ):
        a = anchor.get((r.clients, r.rate_hz))
        ratio = f"{r.p99_ms / a.p99_ms:>10.4f}" if r.server == "gpulab" and a and a.p99_ms else ""
        print(
            f"{labels[r.server]:<{width}} {r.clients:>6} {r.rate_hz:>7g} {r.got_hz:>6.2f} "
            f"{r.lag_n:>6} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.max_ms:>8.1f} {r.cpu_pct:>6.1f} {ratio}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1.5 s per case (under a minute)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="measured seconds per case (default 15)"
    )
    args = parser.parse_args(argv)
    seconds = args.seconds or (1.5 if args.quick else 15.0)
    warmup = 0.3 if args.quick else 2.0

    async def run() -> tuple[list[Row], float]:
        with tempfile.TemporaryDirectory(prefix="gpulab-bench-monitor-") as tmp:
            rows_floor, _ = await bench_server(Path(tmp), "floor", warmup, seconds)
            rows_anchor, _ = await bench_server(Path(tmp), "anchor", warmup, seconds)
            rows_gpulab, cpu = await bench_server(Path(tmp), "gpulab", warmup, seconds)
        assert cpu is not None
        return rows_floor + rows_anchor + rows_gpulab, cpu

    rows, cpu_pct = asyncio.run(run())
    print_table(rows)
    ours = next(r for r in rows if r.server == "gpulab" and r.clients == 50 and r.rate_hz == 20)
    print(f"gpulab sampler thread: {cpu_pct:.3f} % of one core for {GPUS} GPUs at 1 Hz")
    print(f"p99_lag_ms={ours.p99_ms:.3f} sampler_cpu_pct={cpu_pct:.3f}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
