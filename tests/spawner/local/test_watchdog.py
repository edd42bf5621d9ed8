"""The watchdog's decision logic over real process trees (memory figures simulated: no GPU)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from gpulab.spawner.local.watchdog import GPUMemoryWatchdog, SimulatedProcessMemory, process_tree


def test_process_tree_finds_children_and_grandchildren():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys,time; p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)']); print(p.pid, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        grandchild = int(child.stdout.readline())
        tree = process_tree(os.getpid())
        assert {os.getpid(), child.pid, grandchild} <= tree
        assert process_tree(child.pid) == {child.pid, grandchild}
    finally:
        subprocess.run(["kill", str(grandchild)], check=False)
        child.kill()
        child.wait()


async def test_warns_once_then_stops_after_grace_and_resets_when_back_under(tmp_path):
    sample_file = tmp_path / "procs.json"
    events: list[tuple[str, str]] = []

    async def on_over(stage: str, message: str) -> None:
        events.append((stage, message))

    dog = GPUMemoryWatchdog(
        SimulatedProcessMemory(sample_file), interval_seconds=3600, grace_seconds=10
    )
    me = os.getpid()
    dog.watch("alice/", me, {"GPU-a": 1000}, on_over)
    dog._task.cancel()  # drive _check by hand with chosen clocks

    sample_file.write_text(json.dumps({"GPU-a": {str(me): 900}}))
    assert dog._check(SimulatedProcessMemory(sample_file).sample(), now=0) == []

    over = {"GPU-a": {me: 1500}}
    actions = dog._check(over, now=1)
    assert [a[1] for a in actions] == ["warn"]
    assert "1500 MiB used of a 1000 MiB share" in actions[0][2]
    assert dog._check(over, now=5) == []  # warned already, still in grace
    assert dog._check({"GPU-a": {me: 10}}, now=6) == []  # back under: reset
    assert [a[1] for a in dog._check(over, now=7)] == ["warn"]
    assert [a[1] for a in dog._check(over, now=18)] == ["stop"]
    assert dog._check(over, now=30) == []  # stopped once only
    await asyncio.sleep(0)


def test_memory_of_other_users_processes_is_not_counted():
    dog = GPUMemoryWatchdog(SimulatedProcessMemory("/nonexistent"))
    assert dog.usage({"GPU-a": {1: 500, 2: 700}}, {1}) == {"GPU-a": 500}
    assert SimulatedProcessMemory("/nonexistent").sample() == {}
