"""Who may use what: group-restricted profiles, quotas, and bad input, through the REST API."""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.e2e

CATALOG = """
c.GPUCapacity.declared_inventory = '2 x A100-SXM4-80GB'
c.GPUCapacity.profiles = [
    {'slug': 'cpu', 'gpus': 0, 'default': True},
    {'slug': 'gpu-eighth', 'gpus': '1/8'},
    {'slug': 'gpu-quarter', 'gpus': '1/4'},
    {'slug': 'gpu-1', 'gpus': 1},
    {'slug': 'staff-gpu-1', 'display_name': 'Staff GPU', 'gpus': 1, 'groups': ['staff']},
]
c.GPUCapacity.user_quota_gpus = {'quinn': '3/8'}
"""


def test_group_restricted_profile_is_refused_over_api_and_hidden(make_hub):
    hub = make_hub(CATALOG)
    hub.create_user("bob")
    r = hub.spawn("bob", profile="staff-gpu-1")
    assert r.status_code == 403, r.text
    assert r.json()["message"] == (
        "Profile 'staff-gpu-1' is restricted to group(s) staff; user 'bob' is not a member"
    )
    assert hub.allocations() == {}
    assert hub.server_model("bob") is None

    hub.create_user("bob", groups=("staff",))
    hub.start_server("bob", profile="staff-gpu-1")
    assert [a["owner"] for a in hub.allocations().values()] == ["bob"]


def test_quota_counts_fractions_exactly_and_refuses_the_excess(make_hub):
    hub = make_hub(CATALOG)
    hub.create_user("quinn")
    hub.start_server("quinn", "a", profile="gpu-quarter")
    hub.start_server("quinn", "b", profile="gpu-eighth")  # 1/4 + 1/8 = 3/8: exactly the quota
    r = hub.spawn("quinn", "c", profile="gpu-eighth")
    assert r.status_code == 403, r.text
    assert r.json()["message"].startswith(
        "GPU quota exceeded: User 'quinn' asks for 0.125 GPU but has 0 GPU of a 0.375 GPU budget left."
    )
    assert set(hub.allocations()) == {"quinn/a", "quinn/b"}
    # CPU-only servers use no GPU quota
    hub.start_server("quinn", "c", profile="cpu")


@pytest.mark.parametrize(
    ("options", "status", "message"),
    [
        (
            {"profile": "gpu-17"},
            400,
            "Unknown profile 'gpu-17'; available to you: ['cpu', 'gpu-eighth', 'gpu-quarter', 'gpu-1']",
        ),
        ({"profile": 5}, 400, "'profile' must be a profile name (a string), got 5"),
        ({"profile": "gpu-1", "gpus": "-1/2"}, 400, "Unknown server option(s) ['gpus']"),
        ({"profile": ["gpu-1"]}, 400, "'profile' must be a profile name"),
    ],
    ids=["unknown-profile", "not-a-string", "extra-option", "a-list"],
)
def test_bad_server_options_get_400_and_allocate_nothing(make_hub, options, status, message):
    hub = make_hub(CATALOG, name="bad")
    hub.create_user("mallory")
    r = hub.api("POST", "/users/mallory/server", json=options)
    assert r.status_code == status, r.text
    assert message in r.json()["message"]
    assert hub.allocations() == {}
    assert hub.server_model("mallory") is None
    assert hub.capacity()["gpu-1"]["free"] == 2


def test_spawn_waits_in_queue_and_picker_counts_it_until_a_gpu_frees(make_hub):
    hub = make_hub(CATALOG + "c.GPUSimpleLocalSpawner.queue_timeout_seconds = 60\n")
    hub.create_user("alice")
    hub.create_user("bob")
    hub.create_user("carol")
    hub.start_server("alice", profile="gpu-1")
    hub.start_server("bob", profile="gpu-1")
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=hub.spawn("carol", profile="gpu-1")))
    waiter.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and hub.capacity()["gpu-1"]["waiting"] == 0:
        time.sleep(0.2)
    assert hub.capacity()["gpu-1"]["label"] == "1 GPU - none free, 1 waiting"
    hub.stop_server("alice")
    waiter.join(60)
    assert result["r"].status_code in (201, 202), result["r"].text
    hub.wait_ready("carol")
    assert hub.capacity()["gpu-1"]["waiting"] == 0
    assert {a["owner"] for a in hub.allocations().values()} == {"bob", "carol"}
