"""Hub restarts with cleanup_servers = False: servers and their GPU shares survive, exactly."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from traitlets.config import Config

from tests.harness.hub import run_in_kernel


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_running_servers_and_allocations_survive_a_hub_restart(make_hub):
    hub = make_hub(Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"}))
    for user in ("alice", "bob", "carol", "dave"):
        hub.create_user(user)
    hub.start_server("alice", profile="gpu-1")
    hub.start_server("bob", profile="gpu-quarter")
    before = hub.allocations()
    alice_pid, bob_pid = hub.server_pid("alice"), hub.server_pid("bob")
    alice_gpu = before["alice/"]["gpus"][0]["uuid"]

    hub.stop_hub()
    assert _alive(alice_pid) and _alive(bob_pid)
    os.kill(bob_pid, signal.SIGKILL)  # bob's server dies while the hub is down
    hub.start()

    # alice's server is still hers, reachable through the new proxy, on the same GPU
    # (bob's share goes when the restarted hub polls his server: on a loaded runner that check
    # may finish after start-up, in the background)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "bob/" in hub.allocations():
        await asyncio.sleep(0.3)
    after = hub.allocations()
    assert set(after) == {"alice/"}, hub.log()[-4000:]
    assert after["alice/"]["gpus"] == before["alice/"]["gpus"]
    assert hub.server_model("alice")["ready"]
    assert hub.server_model("bob") is None
    out = await run_in_kernel(hub, "alice", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert out.strip() == alice_gpu

    # no GPU is handed out twice: carol gets the other GPU, dave none
    hub.start_server("carol", profile="gpu-1")
    carol_gpu = hub.allocations()["carol/"]["gpus"][0]["uuid"]
    assert carol_gpu != alice_gpu
    r = hub.spawn("dave", profile="gpu-1")
    assert r.status_code == 409, r.text

    hub.stop_server("alice")
    assert set(hub.allocations()) == {"carol/"}
