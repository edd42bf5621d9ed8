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


# -- the NVML source over the labelled FAKE pynvml (tests/harness/fake_nvml) ---------------------


def _nvml_machine(pid: int) -> dict:
    from tests.harness.fake_nvml import a100, mig_instance

    return {
        "gpus": [
            a100(0, processes=[{"pid": pid, "memory_mib": 3000}, {"pid": 1, "memory_mib": 10}]),
            a100(
                1,
                processes=[],  # a MIG parent runs nothing of its own
                mig={
                    "max": 7,
                    "instances": [
                        mig_instance(
                            1, 2, "2g.20gb", 19968, processes=[{"pid": pid, "memory_mib": 500}]
                        ),
                        mig_instance(1, 4, "1g.10gb", 9856),
                    ],
                },
            ),
        ]
    }


def test_the_nvml_source_attributes_mig_work_to_the_instance_and_initialises_once():
    from gpulab.spawner.local.watchdog import NvmlProcessMemory
    from tests.harness.fake_nvml import a100, installed, mig_instance

    with installed(_nvml_machine(4242)) as fake:
        source = NvmlProcessMemory()
        for _ in range(3):
            sample = source.sample()
        assert sample[a100(0)["uuid"]] == {4242: 3000, 1: 10}
        assert a100(1)["uuid"] not in sample  # the parent of MIG instances is no device
        assert sample[mig_instance(1, 2, "2g.20gb", 0)["uuid"]] == {4242: 500}
        assert sample[mig_instance(1, 4, "1g.10gb", 0)["uuid"]] == {}
        assert fake.CALLS["nvmlInit"] == 1 and fake.CALLS["nvmlShutdown"] == 0
        source.close()
        assert fake.CALLS["nvmlShutdown"] == 1


async def test_the_watchdog_closes_its_source_when_nothing_is_watched():
    class Source:
        label = "counting"
        closed = 0

        def sample(self):
            return {}

        def close(self):
            Source.closed += 1

    dog = GPUMemoryWatchdog(Source(), interval_seconds=0.05, grace_seconds=1)

    async def on_over(stage, message):
        raise AssertionError("nothing is over")

    dog.watch("a/", os.getpid(), {}, on_over)
    await asyncio.sleep(0.2)
    dog.unwatch("a/")
    await asyncio.sleep(0.2)
    assert Source.closed == 1
