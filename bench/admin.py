"""python -m bench.admin: the GPU admin panel and the GPU-hour ledger, measured (issue 18).

Phases, each against the real thing:
1. ledger: the openb trace's pods (held-out workload `gpushare40`: nothing in gpulab was tuned
   on it) arrive and leave at their trace times through a real allocator (openb's 1213 nodes),
   whose changes a real `LedgerFeed` writes to a real SQLite ledger, with writes lagging behind
   the changes and the "hub" crashing every `--crash-every` changes (the queued writes lost, the
   allocator reopened from its own store, reconciled). The ledger's GPU-seconds per pod are
   compared with the allocator's own record (its grant, the change that removed it). The
   writer lags `--write-lag-seconds` behind (the hub's writes a change within milliseconds; 1 s
   is generous), so a crash loses the changes of the last second:
   ledger_error_pct = 100 x sum |ledger - record| / sum record. A run without crashes is shown
   too (it must be exact). For context, not as an anchor: what charging each fractional pod a
   whole GPU (OpenCost's "requested GPUs x hours", opencost#3828) would add on the same trace.
2. render: a real hub with `--servers` (500) seeded allocations (a declared inventory of
   simulated GPUs, the allocator's own database written before the hub starts, as a hub
   restarted with that state finds it) and as many users: the panel's REST overview (p50/p95
   over `--repeats`) and its page in Debian's Chromium until the table shows every row,
   interleaved with the stock anchor: JupyterHub's own admin page (/hub/admin, React) until its
   user table shows. render_500_s is the panel page's p50.
3. bulk stop: `--stop` (50) real servers started, stopped with one POST of the panel's bulk
   action (until every server is gone and its share released), against the stock way: one
   DELETE /users/{name}/server per server, all at once (what the stock admin page's per-row
   stop does), until every server is gone.
4. false culls: the culling matrix of tests/hub/culling (tests/harness/culler.py) on a real hub
   with the culler live and rules of seconds (T 30 s, T_gpu 2 s, W 4 s, a check a second), `--cull-
   rounds` times: five servers that must be kept (a kernel busy all along, a running job, a Dask
   task running all along, a "Keep alive" click, keys typed every half second) and two it must
   cull (only the GPU panel
   open and polling; nothing). false_culls counts kept-to-be servers stopped; missed culls and
   each cull's delay after its warning are shown beside it. No stock anchor culls on GPU
   idleness (jupyterhub-idle-culler reads activity only, and the open panel keeps it busy).

Last line: `render_500_s=<x> bulk_stop_50_s=<x> ledger_error_pct=<x> false_culls=<n>`
(targets: render <= 2 s, bulk stop <= 30 s, ledger error < 1 %, false culls 0); a skipped
phase's field is n/a, the line before it saying so. --quick (a few minutes): 2,000 pods of the
trace, 100 seeded servers, 2 repeats, 5 real servers stopped (render_100_s, bulk_stop_5_s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from traitlets.config import Config

from bench._lastline import print_last_lines
from bench._openb import node_csv, pods_of
from bench._spawning import percentile
from gpulab.hub.allocator import (
    Allocator,
    Inventory,
    NoCapacity,
    QuotaExceeded,
    Request,
    SQLiteStore,
)
from gpulab.hub.ledger.feed import LedgerFeed
from gpulab.hub.ledger.store import LedgerStore

MODEL = "A100-SXM4-80GB"
PROFILE = "gpu-quarter"


@dataclass
class Results:
    rows: list[tuple[str, str]] = field(default_factory=list)
    render_s: float | None = None
    bulk_stop_s: float | None = None
    ledger_error_pct: float | None = None
    false_culls: int | None = None

    def add(self, name: str, value: str) -> None:
        self.rows.append((name, value))
        print(f"  {name}: {value}", flush=True)


# -- 1. the ledger against the allocator's own record ------------------------------------------


@dataclass
class Replay:
    record_ms: dict[str, int]
    ledger_ms: dict[str, int]
    whole_gpu_ms: int
    changes: int
    crashes: int
    seconds: float

    @property
    def error_pct(self) -> float:
        total = sum(self.record_ms.values())
        diff = sum(
            abs(self.ledger_ms.get(k, 0) - self.record_ms.get(k, 0))
            for k in set(self.record_ms) | set(self.ledger_ms)
        )
        return 100.0 * diff / total if total else 0.0


def replay(
    workload: str, pods: int, crash_every: int, write_lag_seconds: float, root: Path, seed: int
) -> Replay:
    """Play `pods` of the trace through an allocator feeding a ledger (see the module doc)."""
    trace = [p for p in pods_of(workload) if p.total_gpu_milli > 0][:pods]
    # the trace's own times; rows without a deletion time run to the end
    raw = {p.name: p for p in trace}
    times = _trace_times(workload)
    events: list[tuple[int, int, str]] = []
    end = 0
    for name in raw:
        created, deleted = times[name]
        end = max(end, deleted or created)
        events.append((created, 1, name))
    for name in raw:
        created, deleted = times[name]
        events.append((deleted or end, 0, name))
    events.sort()
    clock = [0.0]
    inventory = Inventory.from_openb_csv(node_csv())
    alloc_url = f"sqlite:///{root}/alloc-{crash_every}-{write_lag_seconds:g}.sqlite"
    ledger = LedgerStore(f"sqlite:///{root}/ledger-{crash_every}-{write_lag_seconds:g}.sqlite")
    alloc_store = SQLiteStore(alloc_url)
    allocator = Allocator(inventory, policy="best-fit", store=alloc_store, clock=lambda: clock[0])
    feed = LedgerFeed(ledger, lambda: inventory, clock=lambda: clock[0])
    allocator.add_listener(feed.listener)
    granted: dict[str, tuple[int, int]] = {}  # id -> (milli, grant)
    record: dict[str, int] = {}
    whole = 0
    changes = crashes = 0
    rng = random.Random(seed)
    t0 = time.perf_counter()
    try:
        for at, arrive, name in events:
            oldest = feed.oldest_queued
            if oldest is not None and oldest <= at - write_lag_seconds:
                clock[0] = oldest + write_lag_seconds
                feed.flush()  # the writer caught up before this change
            clock[0] = float(at)
            if arrive:
                try:
                    p = allocator.place(raw[name].to_request())
                except (NoCapacity, QuotaExceeded):
                    continue
                granted[name] = (p.gpu_milli, at)
            elif name in granted:
                if allocator.release(name) is None:
                    continue
                milli, start = granted.pop(name)
                record[name] = milli * (at - start)
                whole += _whole_gpus(milli) * (at - start)
            else:
                continue
            changes += 1
            if crash_every and rng.random() < 1 / crash_every:  # the hub dies: queue lost
                crashes += 1
                alloc_store.close()
                alloc_store = SQLiteStore(alloc_url)
                allocator = Allocator(
                    inventory, policy="best-fit", store=alloc_store, clock=lambda: clock[0]
                )
                feed = LedgerFeed(ledger, lambda: inventory, clock=lambda: clock[0])
                allocator.add_listener(feed.listener)
                allocator.notify_listeners()
        feed.flush()
        for name, (milli, start) in granted.items():
            record[name] = milli * (end - start)
            whole += _whole_gpus(milli) * (end - start)
        ledger_ms: dict[str, int] = {}
        for interval in ledger.intervals(0, end + 1):
            key = interval.holding.allocation_id
            ledger_ms[key] = ledger_ms.get(key, 0) + interval.milli_seconds(0, end)
        return Replay(record, ledger_ms, whole, changes, crashes, time.perf_counter() - t0)
    finally:
        alloc_store.close()
        ledger.close()


def _whole_gpus(milli: int) -> int:
    """What charging requested GPUs counts: a fraction of a GPU as a whole one."""
    return 1000 if milli < 1000 else milli


def _trace_times(workload: str) -> dict[str, tuple[int, int | None]]:
    import csv
    import gzip

    from bench._openb import trace_file

    out: dict[str, tuple[int, int | None]] = {}
    path = trace_file(f"openb_pod_list_{workload}.csv")
    opener: Callable[..., Any] = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        for row in csv.DictReader(f):
            deleted = row.get("deletion_time") or ""
            out[row["name"]] = (int(row["creation_time"] or 0), int(deleted) if deleted else None)
    return out


def ledger_phase(args: argparse.Namespace, root: Path, out: Results) -> None:
    print(f"ledger: openb {args.workload}, {args.pods} GPU pods", flush=True)
    lag = args.write_lag_seconds
    exact = replay(args.workload, args.pods, 0, lag, root, args.seed)
    crashing = replay(args.workload, args.pods, args.crash_every, lag, root, args.seed)
    out.add(
        "ledger error, clean restarts (%)",
        f"{exact.error_pct:.4f} ({exact.changes} changes, {exact.seconds:.1f} s)",
    )
    out.add(
        f"ledger error, a crash every ~{args.crash_every} changes (%)",
        f"{crashing.error_pct:.4f} ({crashing.crashes} crashes, {crashing.changes} changes)",
    )
    slow = replay(args.workload, args.pods, args.crash_every, 60.0, root, args.seed)
    out.add(
        "  the same, the writer a minute behind (%)",
        f"{slow.error_pct:.4f} ({slow.crashes} crashes)",
    )
    fraction_ms = sum(exact.record_ms.values())
    if fraction_ms:
        out.add(
            "context: whole-GPU charging of the same pods (x fraction x time)",
            f"{exact.whole_gpu_ms / fraction_ms:.2f}",
        )
    out.ledger_error_pct = crashing.error_pct


# -- 2. render and 3. bulk stop, through a real hub -------------------------------------------


def _hub(root: Path, overlay: Config, env: dict[str, str] | None = None) -> Any:
    from tests.harness.hub import Hub

    hub = Hub(root, overlay, env={"GPULAB_METRICS_SERVICE": "0", **(env or {})})
    return hub


def declared(gpus: int) -> str:
    """A declared inventory of `gpus` simulated GPUs (one part holds at most 64)."""
    parts = [64] * (gpus // 64) + ([gpus % 64] if gpus % 64 else [])
    return ", ".join(f"{n} x {MODEL}" for n in parts)


def seed_allocations(state_dir: Path, gpus: int, servers: int) -> None:
    """`servers` quarter-GPU allocations in the allocator's own database, as the hub will find
    them at start (the hub's declared inventory: `gpus` simulated GPUs on this host)."""
    from gpulab.hub import inventory as inv

    node = inv.parse_declared(declared(gpus), cpu_milli=10**9, memory_mib=10**9)
    allocator = Allocator.open(
        Inventory([node]), db_url=f"sqlite:///{state_dir / 'gpulab-allocations.sqlite'}"
    )
    try:
        for i in range(servers):
            allocator.place(
                Request(
                    f"user{i:03d}/",
                    owner=f"user{i:03d}",
                    gpu_milli=250,
                    profile=PROFILE,
                    workload="server",
                )
            )
    finally:
        allocator.store.close()


def render_phase(args: argparse.Namespace, root: Path, out: Results) -> None:
    from playwright.sync_api import sync_playwright

    from tests.harness.browser import CHROMIUM, CHROMIUM_ARGS, log_in_as_admin

    n = args.servers
    gpus = -(-n // 4)
    state = root / "render"
    state.mkdir()
    seed_allocations(state, gpus, n)
    overlay = Config()
    overlay.GPUCapacity.declared_inventory = declared(gpus)
    overlay.GPUCapacity.node_cpu_limit = 10**6
    overlay.GPUCapacity.node_mem_limit = "1000000G"
    hub = _hub(state, overlay)
    hub.start()
    try:
        r = hub.api("POST", "/users", json={"usernames": [f"user{i:03d}" for i in range(n)]})
        assert r.status_code in (201, 409), r.text
        api_s = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = hub.api("GET", "/gpulab/admin/overview")
            api_s.append(time.perf_counter() - t0)
            assert r.status_code == 200 and len(r.json()["workloads"]) == n, r.text[:500]
        panel_s: list[float] = []
        stock_s: list[float] = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
                log_in_as_admin(page, hub)
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    page.goto(f"{hub.url}/hub/gpulab/admin")
                    table = page.get_by_role("table", name="Workloads")
                    table.get_by_role("row", name=f"Workload user{n - 1:03d}/").wait_for(
                        timeout=60_000
                    )
                    panel_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    page.goto(f"{hub.url}/hub/admin")
                    page.get_by_text("user000", exact=True).first.wait_for(timeout=60_000)
                    stock_s.append(time.perf_counter() - t0)
            finally:
                browser.close()
    finally:
        hub.close()
        hub.cleanup()  # its accounts and every process of theirs (job runs, Dask clusters)
    out.add(
        f"overview REST, {n} workloads (s, p50 / p95)",
        f"{statistics.median(api_s):.3f} / {percentile(api_s, 0.95):.3f}",
    )
    out.add(
        f"panel page until all {n} rows show (s, p50 / p95)",
        f"{statistics.median(panel_s):.3f} / {percentile(panel_s, 0.95):.3f}",
    )
    out.add(
        "stock /hub/admin until its user table shows (s, p50 / p95)",
        f"{statistics.median(stock_s):.3f} / {percentile(stock_s, 0.95):.3f}",
    )
    out.add(
        "ratio panel / stock admin page (p50)",
        f"{statistics.median(panel_s) / statistics.median(stock_s):.2f}",
    )
    out.render_s = statistics.median(panel_s)


def _start_all(hub: Any, users: list[str], batch: int = 4) -> None:
    """Start every user's server, `batch` at a time (50 at once on 2 cores would time out)."""
    for i in range(0, len(users), batch):
        group = users[i : i + batch]
        for u in group:
            r = hub.spawn(u, profile=PROFILE)
            assert r.status_code in (201, 202), r.text
        for u in group:
            hub.wait_ready(u, timeout=300)


def _gone(hub: Any, users: list[str]) -> bool:
    r = hub.api("GET", "/users", params={"state": "active"})
    active = {u["name"] for u in r.json()}
    held = {a["owner"] for a in hub.allocations().values()}
    return not (active & set(users)) and not (held & set(users))


def _wait_gone(hub: Any, users: list[str], t0: float) -> float:
    while not _gone(hub, users):
        if time.perf_counter() - t0 > 600:
            raise TimeoutError("servers did not stop")
        time.sleep(0.2)
    return time.perf_counter() - t0


def bulk_stop_phase(args: argparse.Namespace, root: Path, out: Results) -> None:
    n = args.stop
    overlay = Config()
    overlay.GPUCapacity.declared_inventory = declared(-(-n // 4))
    overlay.Spawner.start_timeout = 300  # a start among many on 2 cores
    hub = _hub(root / "stop", overlay)
    hub.start()
    try:
        users = [f"s{i:02d}" for i in range(n)]
        r = hub.api("POST", "/users", json={"usernames": users})
        assert r.status_code in (201, 409), r.text
        panel: list[float] = []
        stock: list[float] = []
        for _ in range(args.stop_rounds):
            _start_all(hub, users)
            ids = list(hub.allocations())
            t0 = time.perf_counter()
            r = hub.api(
                "POST", "/gpulab/admin/actions", json={"action": "stop", "ids": ids}, timeout=600
            )
            assert r.status_code == 200, r.text
            assert all(x["ok"] for x in r.json()["results"]), r.text[:2000]
            panel.append(_wait_gone(hub, users, t0))
            _start_all(hub, users)
            t0 = time.perf_counter()

            async def stop_all() -> None:
                async with httpx.AsyncClient(
                    base_url=f"{hub.url}/hub/api",
                    headers={"Authorization": f"token {hub.token}"},
                    timeout=600,
                ) as client:
                    answers = await asyncio.gather(
                        *(client.delete(f"/users/{u}/server") for u in users)
                    )
                    assert all(a.status_code in (202, 204) for a in answers)

            asyncio.run(stop_all())
            stock.append(_wait_gone(hub, users, t0))
        # every grant of the phase is an interval, and none is left open
        r = hub.api("GET", "/gpulab/usage", params={"by": "user", "bucket": "day"})
        assert r.status_code == 200, r.text
    finally:
        hub.close()
        hub.cleanup()  # its accounts and every process of theirs (job runs, Dask clusters)
    out.add(f"bulk stop of {n} servers, panel action (s, p50)", f"{statistics.median(panel):.2f}")
    out.add(f"stop of {n} servers, stock DELETE each (s, p50)", f"{statistics.median(stock):.2f}")
    out.add("ratio panel / stock", f"{statistics.median(panel) / statistics.median(stock):.2f}")
    out.bulk_stop_s = statistics.median(panel)


def culling_phase(args: argparse.Namespace, root: Path, out: Results) -> None:
    from tests.harness.culler import (
        MATRIX_CULLED,
        culling_policy,
        make_culling_hub,
        run_culling_matrix,
    )

    ui_idle = 30
    false_culls = missed = 0
    delays: list[float] = []
    for round_ in range(args.cull_rounds):
        shared = Path(tempfile.mkdtemp(prefix="gpulab-bench-cull-", dir=root))
        shared.chmod(0o755)

        def make_hub(
            overlay: Config,
            start: bool = True,
            env: dict[str, str] | None = None,
            shared: Path = shared,
        ) -> Any:
            # the culler reads the GPU figures gpulab-metrics gathers: the service runs here
            hub = _hub(shared / "hub", overlay, env={**(env or {}), "GPULAB_METRICS_SERVICE": "1"})
            if start:
                hub.start()
            return hub

        policy = culling_policy(dry_run=False, ui_idle_seconds=ui_idle)
        hub = make_culling_hub(make_hub, shared, shared, policy)
        try:
            outcome = asyncio.run(run_culling_matrix(hub, ui_idle))
        finally:
            hub.close()
            hub.cleanup()  # its accounts and every process of theirs (job runs, Dask clusters)
        false_culls += len(outcome.false_culls)
        missed += len(set(MATRIX_CULLED) - set(outcome.culls))
        delays += list(outcome.delays.values())
        print(
            f"  culling round {round_ + 1}: {outcome.false_culls or 'no'} false culls", flush=True
        )
    out.add(
        f"culling matrix, {args.cull_rounds} round(s) x 5 kept + 2 idle servers",
        f"false culls {false_culls}, missed culls {missed}",
    )
    if delays:
        out.add(
            "cull after its warning (s; W = 4, checks every 1 s), min / max",
            f"{min(delays):.2f} / {max(delays):.2f}",
        )
    out.false_culls = false_culls


#: the sizes of a full run and of --quick (a few minutes: a slice of the trace, fewer seeded
#: servers, a handful of real ones stopped); a size given on the command line wins over both
FULL = {
    "pods": 100_000,
    "servers": 500,
    "repeats": 5,
    "stop": 50,
    "stop_rounds": 1,
    "cull_rounds": 1,
}
QUICK = {"pods": 2_000, "servers": 100, "repeats": 2, "stop": 5, "stop_rounds": 1, "cull_rounds": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every size resolved (what was given, else --quick's or the full run's)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.admin", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes: 2,000 pods, 100 seeded servers, 2 repeats, 5 servers stopped",
    )
    parser.add_argument("--workload", default="gpushare40")
    parser.add_argument("--pods", type=int, help="GPU pods of the trace (all: 100,000)")
    parser.add_argument("--crash-every", type=int, default=400)
    parser.add_argument("--write-lag-seconds", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--servers", type=int, help="seeded servers the panel shows (500)")
    parser.add_argument("--repeats", type=int, help="renders of each page (5)")
    parser.add_argument("--stop", type=int, help="real servers stopped at once (50)")
    parser.add_argument("--stop-rounds", type=int)
    parser.add_argument("--cull-rounds", type=int)
    parser.add_argument(
        "--skip", action="append", default=[], choices=["ledger", "render", "stop", "culling"]
    )
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Results()
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-admin-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)  # the servers' accounts pass through to their homes
        if "ledger" not in args.skip:
            ledger_phase(args, root, out)
        if "render" not in args.skip:
            render_phase(args, root, out)
        if "stop" not in args.skip:
            bulk_stop_phase(args, root, out)
        if "culling" not in args.skip:
            culling_phase(args, root, out)
    print()
    width = max(len(name) for name, _ in out.rows) if out.rows else 10
    print(f"{'measure':<{width}}  value")
    for name, value in out.rows:
        print(f"{name:<{width}}  {value}")
    print_last_lines(*last_fields(args, out))
    return 0


def last_fields(
    args: argparse.Namespace, out: Results
) -> tuple[dict[str, str | None], dict[str, str]]:
    """The last line's fields (None: not measured) and why each None is one (its phase skipped)."""

    def fmt(value: float | int | None, spec: str) -> str | None:
        return None if value is None else format(value, spec)

    measured = (
        (f"render_{args.servers}_s", fmt(out.render_s, ".3f"), "render"),
        (f"bulk_stop_{args.stop}_s", fmt(out.bulk_stop_s, ".2f"), "stop"),
        ("ledger_error_pct", fmt(out.ledger_error_pct, ".4f"), "ledger"),
        ("false_culls", fmt(out.false_culls, "d"), "culling"),
    )
    fields = {name: value for name, value, _ in measured}
    why_not = {name: f"--skip {phase}" for name, _, phase in measured if phase in args.skip}
    return fields, why_not


if __name__ == "__main__":
    sys.exit(main())
