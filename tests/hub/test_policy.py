"""Who may use what: group-restricted profiles, quotas, and bad input, through the REST API."""

from __future__ import annotations

import html
import json
import threading
import time

import pytest
from traitlets.config import Config

from tests.harness.hub import merged

CATALOG = Config(
    GPUCapacity={
        "declared_inventory": "2 x A100-SXM4-80GB",
        "profiles": [
            {"slug": "cpu", "gpus": 0, "default": True},
            {"slug": "gpu-eighth", "gpus": "1/8"},
            {"slug": "gpu-quarter", "gpus": "1/4"},
            {"slug": "gpu-1", "gpus": 1},
            {"slug": "staff-gpu-1", "display_name": "Staff GPU", "gpus": 1, "groups": ["staff"]},
        ],
        "user_quota_gpus": {"quinn": "3/8"},
    }
)


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
    hub = make_hub(merged(CATALOG, Config(GPUSimpleLocalSpawner={"queue_timeout_seconds": 60})))
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


def _new_log(hub, since: int) -> str:
    """What the hub wrote to its log after byte offset `since`."""
    return hub.log_path.read_bytes()[since:].decode(errors="replace")


def test_a_10_mb_spawn_body_is_refused_with_413_and_never_echoed(make_hub):
    hub = make_hub(CATALOG)
    hub.create_user("mallory")
    before = hub.log_path.stat().st_size
    body = {"profile": "x" * (10 * 1024 * 1024)}
    for path in ("/users/mallory/server", "/users/mallory/servers/big"):
        r = hub.api("POST", path, json=body)
        assert r.status_code == 413, r.text[:500]
        assert r.json()["message"].startswith("The request body is 104857")
        assert r.json()["message"].endswith("bytes; gpulab accepts at most 65536 bytes")
        assert len(r.content) < 1000
    assert len(_new_log(hub, before)) < 20_000  # two refusals, not 3 x 10 MB each
    assert "Traceback" not in _new_log(hub, before)
    assert hub.server_model("mallory") is None
    model = hub.api("GET", "/users/mallory", params={"include_stopped_servers": "1"}).json()
    assert set(model["servers"]) <= {""}
    assert hub.allocations() == {}


def test_gpulab_endpoints_cap_request_bodies_at_64_kib(make_hub):
    hub = make_hub(CATALOG)
    hub.create_user("mallory")
    url = "/gpulab/users/mallory/snapshots/some-id/clone"
    body = json.dumps({"name": "n" * 70_000}).encode()
    r = hub.api("POST", url, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:500]
    assert r.json()["message"] == (
        f"The request body is {len(body)} bytes; gpulab accepts at most 65536 bytes"
    )
    model = hub.api("GET", "/users/mallory", params={"include_stopped_servers": "1"}).json()
    assert set(model["servers"]) <= {""}
    # the spawn form and the workspaces page (form posts) have the same cap
    admin = hub.login("admin", hub.admin_password())
    xsrf = admin.cookies.get("_xsrf", path="/hub/")
    for page in ("/hub/spawn/admin/big", "/hub/gpulab/workspaces"):
        r = admin.post(page, data={"_xsrf": xsrf, "profile": "cpu", "name": "n" * 70_000})
        assert r.status_code == 413, (page, r.text[-500:])
        assert "gpulab accepts at most 65536 bytes" in r.text
    model = hub.api("GET", "/users/admin", params={"include_stopped_servers": "1"}).json()
    assert set(model["servers"]) <= {""}
    # a body under the cap is read, and its bad value echoed only shortened
    r = hub.api("POST", url, json={"name": "N" * 5000})
    assert r.status_code in (400, 404), r.text[:500]
    assert len(r.json()["message"]) < 300


def test_long_values_are_echoed_shortened_and_refusals_log_one_line(make_hub):
    hub = make_hub(CATALOG)
    hub.create_user("mallory")
    before = hub.log_path.stat().st_size
    r = hub.spawn("mallory", profile="p" * 5000)
    assert r.status_code == 400, r.text[:500]
    message = r.json()["message"]
    assert message.startswith("Unknown profile '" + "p" * 79 + "…; available to you: ['cpu'")
    assert len(message) < 300
    r = hub.spawn("mallory", profile="cpu", restore_kernels=["k"] * 2000)
    assert r.status_code == 400
    assert r.json()["message"].startswith("'restore_kernels' must be true or false, got ['k'")
    assert len(r.json()["message"]) < 200
    log = _new_log(hub, before)
    assert "Unknown profile 'ppp" in log
    assert "Traceback" not in log
    assert max(len(line) for line in log.splitlines()) < 1000
    assert hub.allocations() == {}


def _spawn_page_outcome(session, user: str, server: str, data: dict[str, str]) -> str:
    """POST the spawn form, then follow the pending page until the start has ended; the text a
    person ends up reading."""
    data = {**data, "_xsrf": session.cookies.get("_xsrf", path="/hub/")}
    page = session.post(f"/hub/spawn/{user}/{server}", data=data)
    deadline = time.monotonic() + 60
    while "/spawn-pending/" in str(page.url) and time.monotonic() < deadline:
        if 'id="progress-message"' not in page.text:
            break  # no longer the progress page: it says how the start ended
        time.sleep(0.5)
        page = session.get(f"/hub/spawn-pending/{user}/{server}")
    return html.unescape(page.text)


def test_the_spawn_form_shows_why_a_start_was_refused(make_hub):
    hub = make_hub(CATALOG)
    admin = hub.login("admin", hub.admin_password())
    hub.start_server("admin", profile="gpu-1")
    before = hub.log_path.stat().st_size
    # a second GPU server is over the 1-GPU default quota: the page says so and what to do
    text = _spawn_page_outcome(admin, "admin", "more", {"profile": "gpu-quarter"})
    assert (
        "GPU quota exceeded: User 'admin' asks for 0.25 GPU but has 0 GPU of a 1 GPU budget "
        "left. Stop one of your GPU servers, or a CPU-only server ('cpu')."
    ) in text
    assert "Traceback" not in _new_log(hub, before)
    assert set(hub.allocations()) == {"admin/"}
    model = hub.api("GET", "/users/admin", params={"include_stopped_servers": "1"}).json()
    assert "more" not in model["servers"]
