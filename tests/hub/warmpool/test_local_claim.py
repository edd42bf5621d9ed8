"""Warm pools on the embedded default, through a real hub: members are pre-started on preemptible
reservations of the pool's account, a start takes one and it becomes that user's server (her
account, her token, her home), and the pool refills."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import httpx
import psutil
from traitlets.config import Config

from tests.harness.hub import merged, run_in_kernel

POOL = "gpulab:warm-pool"
TWO_A100 = Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"})


def _pool(profile: str = "gpu-quarter", low: int = 2, high: int = 2) -> Config:
    return Config(
        GPUWarmPool={
            "pools": [{"profile": profile, "min": low, "max": high}],
            "check_interval_seconds": 0.5,
        }
    )


def _pool_allocations(hub) -> dict[str, dict]:
    return {k: a for k, a in hub.allocations().items() if a["owner"] == POOL}


def _wait_ready(hub, profile: str, count: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = hub.capacity()[profile]["ready_now"]
        if seen >= count:
            return
        time.sleep(0.3)
    raise AssertionError(
        f"{count} warm {profile} members not ready, {seen} are:\n{hub.log()[-3000:]}"
    )


def _members(hub) -> list[psutil.Process]:
    """The hub's warm pool members waiting for a claim (still its own account's: root here)."""
    return [
        p
        for p in psutil.Process(hub.proc.pid).children()
        if "gpulab.spawner.singleuser.warm_server" in p.cmdline() and p.uids().real == 0
    ]


def _ids(pid: int) -> tuple[set[str], set[str], list[str]]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return set(fields["Uid"].split()), set(fields["Gid"].split()), fields["Groups"].split()


async def test_a_start_takes_a_ready_member_that_becomes_her_server_and_the_pool_refills(make_hub):
    hub = make_hub(merged(TWO_A100, _pool()))
    hub.create_user("alice")
    hub.create_user("bob")
    _wait_ready(hub, "gpu-quarter", 2)
    reserved = _pool_allocations(hub)
    assert len(reserved) == 2
    assert all(a["priority"] == "preemptible" for a in reserved.values()), reserved
    # before a claim a member is nobody's: it listens on nothing and holds no token or secret
    members = _members(hub)
    assert len(members) == 2
    for member in members:
        assert member.net_connections(kind="inet") == []
        environ = Path(f"/proc/{member.pid}/environ").read_bytes()
        for secret in (b"TOKEN", b"SECRET", b"CRYPT_KEY", b"JUPYTERHUB_"):
            assert secret not in environ
        assert member.nice() == 19  # refilling takes only idle CPU

    hub.start_server("alice", profile="gpu-quarter")
    log = hub.log()
    assert re.search(r"alice/ \(profile gpu-quarter\) served warm by gpulab:warm-pool/", log), (
        "\n".join(x for x in log.splitlines() if "arm" in x or "Spawning" in x or "rror" in x)
    )
    mine = hub.allocations()["alice/"]
    # her share is the reservation the member held: same GPU, now hers and on-demand
    assert [g["uuid"] for g in mine["gpus"]] in [
        [g["uuid"] for g in a["gpus"]] for a in reserved.values()
    ]
    assert mine["owner"] == "alice" and mine["priority"] == "on-demand"

    # the process is hers: every uid and gid her account's, her groups only
    account = hub.account("alice")
    pid = hub.server_pid("alice")
    uids, gids, groups = _ids(pid)
    assert uids == {str(account.pw_uid)} and gids == {str(account.pw_gid)}
    status = Path(f"/proc/{pid}/status").read_text()
    assert re.search(r"^CapEff:\s+0+$", status, re.M) and re.search(r"^CapPrm:\s+0+$", status, re.M)
    assert psutil.Process(pid).nice() == 0
    assert set(groups) <= {str(g) for g in os.getgrouplist(account.pw_name, account.pw_gid)}
    # a kernel runs as her, in her home, on her share, with her server's environment (the
    # server's own /proc/<pid>/environ is the member's start environment: read it from a kernel)
    out = await run_in_kernel(
        hub,
        "alice",
        "import os; e = os.environ; print(os.getuid(), os.getcwd(), e['GPULAB_PROFILE'], "
        "e['CUDA_VISIBLE_DEVICES'], e['JUPYTERHUB_USER'], e['HOME'])",
    )
    home = str(hub.home("alice"))
    uuid = mine["gpus"][0]["uuid"]
    assert out.split() == [str(account.pw_uid), home, "gpu-quarter", uuid, "alice", home]
    # her token travels in the claim, never in a process's start environment
    assert b"JUPYTERHUB_API_TOKEN" not in Path(f"/proc/{pid}/environ").read_bytes()
    assert os.stat(hub.home("alice")).st_uid == account.pw_uid

    # her server answers her token only: bob's is refused
    hub.start_server("bob", profile="gpu-quarter")
    bob_token = hub.api("POST", "/users/bob/tokens", json={"note": "t"}).json()["token"]
    alice_token = hub.api("POST", "/users/alice/tokens", json={"note": "t"}).json()["token"]
    async with httpx.AsyncClient(base_url=f"{hub.url}/user/alice/") as client:
        r = await client.get("api/status", headers={"Authorization": f"token {bob_token}"})
        assert r.status_code == 403, r.text
        r = await client.get("api/status", headers={"Authorization": f"token {alice_token}"})
        assert r.status_code == 200, r.text
        # VS Code in the browser works in a claimed server as in a cold one: code-server starts
        # as her, bob is refused by her server
        r = await client.get("vscode/", headers={"Authorization": f"token {alice_token}"})
        assert r.status_code == 302 and "folder=" in r.headers["location"], (r.status_code, r.text)
        r = await client.get("vscode/", headers={"Authorization": f"token {bob_token}"})
        assert r.status_code == 403, r.text
    code_servers = [
        p
        for p in psutil.Process(pid).children(recursive=True)
        if "code-server" in " ".join(p.cmdline())
    ]
    assert code_servers and {p.uids().real for p in code_servers} == {account.pw_uid}
    assert _ids(hub.server_pid("bob"))[0] == {str(hub.account("bob").pw_uid)}

    # the pool refills with new members (two claims in the demand window: max 2 still)
    _wait_ready(hub, "gpu-quarter", 2)
    assert not set(_pool_allocations(hub)) & set(reserved)

    # the ledger: each member's interval ended "handed-over" where the user's began
    ended = {i.holding.allocation_id: i.end_reason for i in hub.ledger_intervals()}
    handed = [k for k, why in ended.items() if why == "handed-over"]
    assert len(handed) == 2 and all(k.startswith(POOL + "/") for k in handed), ended


def test_a_start_of_another_profile_is_cold_and_the_member_keeps_its_reservation(make_hub):
    hub = make_hub(merged(TWO_A100, _pool(low=1, high=1)))
    hub.create_user("alice")
    _wait_ready(hub, "gpu-quarter", 1)
    (member,) = _pool_allocations(hub)
    hub.start_server("alice", profile="gpu-half")
    assert "served warm" not in hub.log()
    assert set(_pool_allocations(hub)) == {member}
    assert hub.server_env("alice")["GPULAB_PROFILE"] == "gpu-half"


def test_an_on_demand_start_takes_a_members_gpu_when_nothing_else_is_free(make_hub):
    # one A100, a whole-GPU pool member holds it: alice's whole-GPU start of another profile
    # would not fit, so the member gives its GPU back
    config = Config(
        GPUCapacity={
            "declared_inventory": "1 x A100-SXM4-80GB",
            "profiles": [
                {"slug": "cpu", "display_name": "CPU", "gpus": 0, "default": True},
                {"slug": "gpu-1", "display_name": "1 GPU", "gpus": 1},
                {
                    "slug": "gpu-1-big",
                    "display_name": "1 GPU, more memory",
                    "gpus": 1,
                    "mem_limit": "2G",
                },
            ],
        }
    )
    hub = make_hub(merged(config, _pool(profile="gpu-1", low=1, high=1)))
    hub.create_user("alice")
    _wait_ready(hub, "gpu-1", 1)
    hub.start_server("alice", profile="gpu-1-big")
    assert hub.allocations()["alice/"]["owner"] == "alice"
    assert _pool_allocations(hub) == {}
    assert re.search(r"Warm pool member gpulab:warm-pool/gpu-1-\d+ gives its GPU back", hub.log())


def test_nobody_may_be_the_pools_account(make_hub):
    hub = make_hub(TWO_A100)
    r = hub.api("POST", f"/users/{POOL}")
    assert r.status_code == 400, r.text
    assert hub.api("GET", f"/users/{POOL}").status_code == 404


def test_the_spawn_page_marks_profiles_ready_now(make_hub):
    hub = make_hub(merged(TWO_A100, _pool(low=1, high=1)))
    _wait_ready(hub, "gpu-quarter", 1)
    admin = hub.login("admin", hub.admin_password())
    page = admin.get("/hub/spawn").text
    quarter = page[page.index('id="profile-gpu-quarter"') : page.index('id="profile-gpu-half"')]
    assert 'class="badge text-bg-success gpulab-ready-now" data-ready="1"' in quarter
    assert page.count("gpulab-ready-now") == 1


def test_a_stampede_takes_the_pool_then_starts_cold_and_nothing_fails(make_hub):
    # the bench's 20 logins in 5 s against 10 members, scaled to what CI's 2 cores carry
    hub = make_hub(merged(TWO_A100, _pool(profile="gpu-eighth", low=3, high=3)))
    users = [f"u{i}" for i in range(6)]
    for user in users:
        hub.create_user(user)
    _wait_ready(hub, "gpu-eighth", 3)
    answers = {}

    def login(user: str) -> None:
        answers[user] = hub.spawn(user, profile="gpu-eighth").status_code

    threads = [threading.Thread(target=login, args=(u,)) for u in users]
    for thread in threads:
        thread.start()
        time.sleep(0.25)
    for thread in threads:
        thread.join()
    assert set(answers.values()) <= {201, 202}, answers
    for user in users:
        hub.wait_ready(user, timeout=180)
    log = hub.log()
    warm = {
        u
        for u in users
        if re.search(rf"GPU allocation {u}/ \(profile gpu-eighth\) served warm", log)
    }
    assert len(warm) == 3, log[-4000:]
    # every server is its user's, warm or cold: her allocation, her account
    allocations = hub.allocations()
    assert all(allocations[f"{u}/"]["owner"] == u for u in users)
    for user in users:
        assert _ids(hub.server_pid(user))[0] == {str(hub.account(user).pw_uid)}
    # and the pool is back to three ready members
    _wait_ready(hub, "gpu-eighth", 3)


def test_a_member_that_cannot_serve_is_discarded_and_the_start_runs_cold_on_its_share(make_hub):
    # a variable Python reads at start cannot be applied to a running member: it refuses
    overlay = Config(Spawner={"environment": {"PYTHONUNBUFFERED": "1"}})
    hub = make_hub(merged(TWO_A100, _pool(low=1, high=1), overlay))
    hub.create_user("alice")
    _wait_ready(hub, "gpu-quarter", 1)
    (reserved,) = _pool_allocations(hub).values()
    hub.start_server("alice", profile="gpu-quarter")
    log = hub.log()
    assert re.search(
        r"could not serve alice/ \(needs PYTHONUNBUFFERED at start\); starting cold", log
    )
    mine = hub.allocations()["alice/"]
    assert mine["owner"] == "alice" and mine["gpus"] == reserved["gpus"]
    assert _ids(hub.server_pid("alice"))[0] == {str(hub.account("alice").pw_uid)}
    assert hub.server_env("alice")["PYTHONUNBUFFERED"] == "1"  # a cold start's own environment
