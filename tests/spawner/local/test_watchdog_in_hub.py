"""The GPU memory watchdog warns, then stops, a server that outgrows its fractional share.

No GPU here: per-process GPU memory comes from a SIMULATED source (a JSON file the test writes,
{uuid: {pid: MiB}}), read through the same watchdog code that reads NVML on a GPU machine.
"""

from __future__ import annotations

import json
import time

from traitlets.config import Config


def _watched_hub(make_hub, tmp_path, inventory: str, grace_seconds: float):
    """A hub whose watchdog reads the SIMULATED per-process memory file it returns beside it."""
    processes = tmp_path / "simulated-gpu-processes.json"
    hub = make_hub(
        Config(
            GPUCapacity={"declared_inventory": inventory},
            GPUSimpleLocalSpawner={
                "simulated_gpu_processes_file": str(processes),
                "watchdog_interval_seconds": 0.3,
                "watchdog_grace_seconds": grace_seconds,
            },
        )
    )
    return hub, processes


def test_server_over_its_share_is_warned_then_stopped_and_its_share_freed(make_hub, tmp_path):
    hub, processes = _watched_hub(make_hub, tmp_path, "1 x A100-SXM4-80GB", grace_seconds=2)
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="gpu-eighth")  # a 10240 MiB share
    hub.start_server("bob", profile="gpu-eighth")
    uuid = hub.allocations()["alice/"]["gpus"][0]["uuid"]
    alice, bob = hub.server_pid("alice"), hub.server_pid("bob")

    # within the share: nothing happens
    processes.write_text(json.dumps({uuid: {str(alice): 9000, str(bob): 10000}}))
    time.sleep(1.5)
    assert hub.allocations()["alice/"]["events"] == []

    # alice goes over: warned at once, stopped after the grace period; bob is untouched
    processes.write_text(json.dumps({uuid: {str(alice): 30000, str(bob): 10000}}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "alice/" in hub.allocations():
        time.sleep(0.2)
    assert "alice/" not in hub.allocations()
    assert "bob/" in hub.allocations()
    log = hub.log()
    assert "alice/ is over its GPU share" in log and "30000 MiB used of a 10240 MiB share" in log
    assert "alice/ stayed over its GPU share" in log
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and hub.server_model("alice") is not None:
        time.sleep(0.2)
    assert hub.server_model("alice") is None
    assert hub.capacity()["gpu-eighth"]["free"] == 7  # all but bob's eighth


def test_cpu_only_and_whole_gpu_servers_are_stopped_on_a_gpu_not_theirs(make_hub, tmp_path):
    hub, processes = _watched_hub(make_hub, tmp_path, "2 x A100-SXM4-80GB", grace_seconds=1)
    for user in ("cyd", "wes", "val"):
        hub.create_user(user)
    hub.start_server("cyd", profile="cpu")
    hub.start_server("wes", profile="gpu-1")
    hub.start_server("val", profile="gpu-1")
    wes_gpu = hub.allocations()["wes/"]["gpus"][0]["uuid"]
    val_gpu = hub.allocations()["val/"]["gpus"][0]["uuid"]
    cyd, wes, val = hub.server_pid("cyd"), hub.server_pid("wes"), hub.server_pid("val")

    # each whole-GPU server fills its own GPU: that is its share
    processes.write_text(json.dumps({wes_gpu: {str(wes): 80000}, val_gpu: {str(val): 80000}}))
    time.sleep(1.5)
    assert hub.server_model("wes") and hub.server_model("val") and hub.server_model("cyd")

    # the CPU-only server and wes open val's GPU anyway: both stopped, val untouched
    processes.write_text(
        json.dumps({val_gpu: {str(val): 70000, str(cyd): 500, str(wes): 1000}, wes_gpu: {}})
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (hub.server_model("cyd") or hub.server_model("wes")):
        time.sleep(0.2)
    assert hub.server_model("cyd") is None and hub.server_model("wes") is None
    assert hub.server_model("val") is not None
    log = hub.log()
    assert f"{val_gpu}: 500 MiB used of a GPU that is not in its share" in log
    assert "cyd/ stayed over its GPU share" in log and "wes/ stayed over its GPU share" in log
