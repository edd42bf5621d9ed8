"""Threads racing on one allocator, and a process killed in the middle of writing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from gpulab.hub.allocator import AllocationError, Allocator, Inventory, NoCapacity, Request


def test_threads_racing_for_the_last_gpu_exactly_one_wins(tmp_path, make_node):
    inv = Inventory([make_node("n", gpus=1)])
    alloc = Allocator.open(inv, f"sqlite:///{tmp_path}/a.sqlite")
    barrier = threading.Barrier(16)
    wins: list[str] = []
    losses: list[str] = []

    def grab(k: int) -> None:
        barrier.wait()
        try:
            alloc.place(Request(f"user{k}/gpu", owner=f"user{k}", num_gpu=1))
            wins.append(f"user{k}")
        except NoCapacity:
            losses.append(f"user{k}")

    threads = [threading.Thread(target=grab, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 15
    assert [p.request.owner for p in alloc.allocations()] == wins


def test_many_threads_placing_and_releasing_never_over_commit(small_inventory, assert_consistent):
    alloc = Allocator(small_inventory, policy="gpulab")
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(60):
                rid = f"w{k}-{j}"
                try:
                    alloc.place(Request(rid, owner=f"u{k}", gpu_milli=125 * (1 + j % 7)))
                except AllocationError:
                    continue
                if j % 3:
                    alloc.release(rid)
        except BaseException as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert_consistent(alloc)


CHILD = textwrap.dedent(
    """
    import sys
    from gpulab.hub.allocator import GPU, Allocator, AllocationError, Inventory, Node, Request
    inv = Inventory([Node(f"n{i}", 64000, 262144, tuple(GPU(f"n{i}-gpu{j}", "A100", index=j)
                     for j in range(4))) for i in range(3)])
    alloc = Allocator.open(inv, sys.argv[1], policy="best-fit")
    print("ready", flush=True)
    k = 0
    while True:
        k += 1
        try:
            alloc.place(Request(f"r{k}", owner="u", gpu_milli=125 * (1 + k % 7)))
        except AllocationError:
            for p in alloc.allocations()[: 3]:
                alloc.release(p.id)
    """
)


def test_a_process_killed_mid_write_leaves_a_consistent_database(
    tmp_path, make_node, assert_consistent
):
    url = f"sqlite:///{tmp_path}/crash.sqlite"
    inv = Inventory(
        [make_node(f"n{i}", gpus=4, cpu_milli=64_000, memory_mib=262_144) for i in range(3)]
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for delay in (0.3, 0.5, 0.8):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url], stdout=subprocess.PIPE, env=env, text=True
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        alloc = Allocator.open(inv, url, policy="best-fit", strict=True)
        assert alloc.allocations(), "the child should have written allocations"
        assert_consistent(alloc)
        alloc.store.close()
