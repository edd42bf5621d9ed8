"""GPUWarmPool in-process over a real GPUCapacity and allocator, with a stand-in backend (TEST
DOUBLE: members are records, not processes; the embedded default's real members are tested
through a real hub in tests/hub/warmpool/test_local_claim.py)."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY, generate_latest
from traitlets.config import Config

from gpulab.hub.allocator import Request
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.warmpool import WARM_POOL_OWNER, is_pool_allocation
from gpulab.hub.warmpoolservice import GPUWarmPool, WarmStartFailed


class StandInMember:
    def __init__(self, member_id, profile, fingerprint, fail=False):
        self.id, self.profile, self.fingerprint = member_id, profile, fingerprint
        self.started_at = asyncio.get_running_loop().time()
        self.ready = False
        self.alive = True
        self.discarded = False
        self.fail = fail

    async def wait_ready(self, timeout):
        if self.fail:
            self.alive = False
            raise WarmStartFailed("stand-in told to fail")
        self.ready = True

    async def discard(self):
        self.discarded, self.alive = True, False


class StandInBackend:
    def __init__(self):
        self.version = "v1"
        self.started: list[StandInMember] = []
        self.fail_next = 0

    def fingerprint(self, profile):
        return f"{profile.slug}-{self.version}"

    async def start_member(self, member_id, profile, placement):
        member = StandInMember(
            member_id, profile.slug, self.fingerprint(profile), self.fail_next > 0
        )
        self.fail_next = max(0, self.fail_next - 1)
        self.started.append(member)
        return member


def _pool(tmp_path, pools, inventory="1 x A100-SXM4-80GB", **settings):
    c = Config()
    c.GPUCapacity.inventory_source = "declared"
    c.GPUCapacity.declared_inventory = inventory
    c.GPUCapacity.db_url = f"sqlite:///{tmp_path / 'alloc.sqlite'}"
    c.GPUWarmPool.pools = pools
    for key, value in settings.items():
        setattr(c.GPUWarmPool, key, value)
    capacity = GPUCapacity(config=c)
    pool = GPUWarmPool(config=c)
    pool.load_pools(capacity)
    backend = StandInBackend()
    pool.attach(capacity, backend)
    return pool, capacity, backend


async def _settle(pool):
    await pool.refill()
    await asyncio.gather(*pool._starting)


async def test_the_pool_fills_to_min_on_preemptible_reservations_of_its_own_account(tmp_path):
    pool, capacity, backend = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 2, "max": 3}])
    await _settle(pool)
    held = [p for p in capacity.allocator.allocations() if is_pool_allocation(p.request.id)]
    assert len(held) == 2 and pool.ready_count("gpu-quarter") == 2
    assert {p.request.owner for p in held} == {WARM_POOL_OWNER}
    assert {p.request.priority for p in held} == {"preemptible"}
    assert {p.request.workload for p in held} == {"warm"}


async def test_a_claim_takes_the_oldest_and_demand_grows_the_pool_up_to_max(tmp_path):
    pool, capacity, backend = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 1, "max": 2}])
    await _settle(pool)
    first = backend.started[0]
    assert pool.claim("gpu-half") is None
    claimed = pool.claim("gpu-quarter")
    assert claimed is first and first.id not in pool.members
    # handed over to alice: the reservation becomes hers
    mine = await capacity.hand_over(claimed.id, Request("alice/", owner="alice", gpu_milli=250))
    assert mine.request.owner == "alice"
    await _settle(pool)
    assert pool.desired["gpu-quarter"] == 2 and pool.ready_count("gpu-quarter") == 2
    assert pool.claimed_total["gpu-quarter"] == 1


async def test_stale_members_are_recreated_when_what_they_were_made_from_changes(tmp_path):
    pool, capacity, backend = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 2, "max": 2}])
    await _settle(pool)
    old = list(backend.started)
    backend.version = "v2"  # e.g. an upgraded environment, or the profile changed
    assert pool.claim("gpu-quarter") is None  # a stale member is never handed out
    await _settle(pool)
    assert all(m.discarded for m in old)
    assert {m.fingerprint for m in pool.members.values()} == {"gpu-quarter-v2"}
    held = {p.request.id for p in capacity.allocator.allocations()}
    assert held == set(pool.members)


async def test_failed_and_dead_members_are_counted_replaced_and_their_gpus_released(tmp_path):
    pool, capacity, backend = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 1, "max": 1}])
    backend.fail_next = 1
    await _settle(pool)
    assert pool.failed_total["gpu-quarter"] == 1 and pool.members == {}
    assert capacity.allocator.allocations() == []
    await _settle(pool)
    (member,) = pool.members.values()
    member.alive = False  # ended by itself
    await _settle(pool)
    assert pool.failed_total["gpu-quarter"] == 2 and member.id not in pool.members
    assert pool.ready_count("gpu-quarter") == 1


async def test_the_system_quota_caps_every_pool_together(tmp_path):
    pool, capacity, _ = _pool(
        tmp_path, [{"profile": "gpu-quarter", "min": 8, "max": 8}], gpu_quota=0.5
    )
    await _settle(pool)
    assert len(pool.members) == 2  # two quarters make the half GPU allowed


async def test_an_on_demand_start_takes_a_members_gpu_and_the_member_is_stopped(tmp_path):
    pool, capacity, backend = _pool(tmp_path, [{"profile": "gpu-1", "min": 1, "max": 1}])
    await _settle(pool)
    (member,) = backend.started
    placement = await capacity.place(Request("alice/", owner="alice", num_gpu=1))
    assert placement.request.owner == "alice"
    assert member.discarded and pool.members == {}


async def test_a_previous_hubs_reservations_are_swept(tmp_path):
    pool, capacity, _ = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 0, "max": 0}])
    capacity.allocator.place(
        Request(f"{WARM_POOL_OWNER}/gpu-quarter-99", owner=WARM_POOL_OWNER, gpu_milli=250)
    )
    assert await pool.sweep() == [f"{WARM_POOL_OWNER}/gpu-quarter-99"]
    assert capacity.allocator.allocations() == []


async def test_metrics_say_desired_ready_claimed_and_failed_per_profile(tmp_path):
    pool, _, backend = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 2, "max": 2}])
    await _settle(pool)
    pool.claim("gpu-quarter")
    text = generate_latest(REGISTRY).decode()
    assert 'gpulab_warm_pool_desired{profile="gpu-quarter"} 2.0' in text
    assert 'gpulab_warm_pool_ready{profile="gpu-quarter"} 1.0' in text
    assert 'gpulab_warm_pool_claimed_total{profile="gpu-quarter"} 1.0' in text
    assert 'gpulab_warm_pool_failed_total{profile="gpu-quarter"} 0.0' in text


async def test_close_stops_every_member_and_releases_its_gpu(tmp_path):
    pool, capacity, backend = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 2, "max": 2}])
    await _settle(pool)
    await pool.close()
    assert all(m.discarded for m in backend.started)
    assert capacity.allocator.allocations() == []


class SweepingBackend(StandInBackend):
    """Members that outlive the hub process (as Kubernetes pods): `left` are a previous hub's."""

    def __init__(self, left):
        super().__init__()
        self.left = set(left)
        self.kept: set[str] | None = None

    async def sweep_members(self, keep):
        self.kept = set(keep)
        swept = sorted(self.left - keep)
        self.left -= set(swept)
        return swept


async def test_a_backend_whose_members_outlive_the_hub_stops_them_before_the_release(tmp_path):
    pool, capacity, _ = _pool(tmp_path, [{"profile": "gpu-quarter", "min": 0, "max": 0}])
    orphan = f"{WARM_POOL_OWNER}/gpu-quarter-99"
    backend = SweepingBackend([orphan])
    pool._backend = backend
    capacity.allocator.place(Request(orphan, owner=WARM_POOL_OWNER, gpu_milli=250))
    assert await pool.sweep() == [orphan]
    assert backend.left == set() and backend.kept == set()  # the pool knew no member
    assert capacity.allocator.allocations() == []
