"""GPU jobs through a real hub's REST API with users' own tokens: submit a script to a GPU share,
follow it to the end, read its logs and outputs; the run survives its owner's server being
stopped; cancel frees the share before it answers; another user reaches nothing of it; bad
requests are 4xx naming the field and leave nothing behind."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from gpulab.hub.jobservice.service import NOT_YET_CONSIDERED
from tests.harness.jobs import CHECKPOINTING_SCRIPT, INVENTORY, put, until, user_client
from tests.harness.wait import wait_for


def test_a_users_script_runs_on_a_gpu_share_with_logs_and_outputs_and_outlives_her_server(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="cpu")  # makes her account and home
    put(
        hub,
        "alice",
        "projects/train.py",
        "import os, sys, time\n"
        "print('epochs', sys.argv[1], 'on', os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
        "print('inventory', os.environ.get('GPULAB_GPU_INVENTORY'), flush=True)\n"
        "time.sleep(2)  # a share held for whole seconds: GPU-hours in the ledger\n"
        "open(os.path.join(os.environ['GPULAB_OUTPUT_DIR'], 'model.bin'), 'w').write('w' * 10)\n",
    )
    hub.stop_server("alice")  # the job does not need her server
    alice = user_client(hub, "alice")
    r = alice.post(
        "/users/alice/jobs",
        json={
            "name": "train",
            "kind": "script",
            "path": "projects/train.py",
            "args": ["3"],
            "profile": "gpu-quarter",
        },
    )
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["state"] == "queued" and run["spec"]["profile"] == "gpu-quarter"
    done = until(alice, f"/users/alice/jobs/{run['id']}", "succeeded", "failed")
    assert done["state"] == "succeeded", (done, hub.log()[-3000:])
    assert done["outputs"] == [{"path": "model.bin", "size_bytes": 10}]
    (attempt,) = done["attempts"]
    assert attempt["state"] == "succeeded" and attempt["exit_code"] == 0
    logs = alice.get(f"/users/alice/jobs/{run['id']}/logs").json()
    assert not [a for a in hub.allocations() if a.startswith("alice/job-")]  # given back
    assert logs["data"].startswith("epochs 3 on GPU-") and logs["ended"] is True
    # declared GPUs: the run's GPU report simulates them, as a server's monitor does
    assert "\ninventory declared\n" in logs["data"], logs["data"]
    assert logs["next_offset"] == len(logs["data"].encode())
    listed = alice.get("/users/alice/jobs").json()["runs"]
    assert [r["id"] for r in listed] == [run["id"]]
    # bob holds no scope on alice: nothing of hers, not even whether the run exists
    bob = user_client(hub, "bob")
    assert bob.get(f"/users/alice/jobs/{run['id']}").status_code == 403
    assert bob.get(f"/users/alice/jobs/{run['id']}/logs").status_code == 403
    assert bob.delete(f"/users/alice/jobs/{run['id']}").status_code == 403
    assert bob.get(f"/users/bob/jobs/{run['id']}").status_code == 404  # not under his name

    # her GPU-hours: the run's quarter share as a job's, measured by the run's own GPU report
    # (the wrapper pushes its share's figures), so used and idle add up to allocated
    def job_row() -> dict[str, Any] | None:
        r = alice.get("/users/alice/usage", params={"by": "workload"})
        assert r.status_code == 200, r.text
        body = r.json()
        rows = [r for r in body["rows"] if r["workload"] == "job"]
        return rows[0] if rows and rows[0]["allocated_gpu_hours"] > 0 else None

    row = wait_for("the run's GPU-hours in alice's usage", job_row, 30, 0.5)
    assert row["unmonitored_gpu_hours"] == 0
    assert row["used_gpu_hours"] + row["idle_gpu_hours"] == pytest.approx(
        row["allocated_gpu_hours"]
    )


def test_cancel_frees_the_share_before_it_answers_and_bad_requests_name_the_field(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    put(hub, "alice", "sleep.py", "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    alice = user_client(hub, "alice")
    body = {"name": "long", "kind": "script", "path": "sleep.py", "profile": "gpu-1"}
    r = alice.post("/users/alice/jobs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    until(alice, f"/users/alice/jobs/{run_id}", "running")
    assert f"alice/job-{run_id}" in hub.allocations()
    r = alice.delete(f"/users/alice/jobs/{run_id}")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "canceled"
    assert r.json()["reason"] == "canceled by alice"
    assert f"alice/job-{run_id}" not in hub.allocations()  # free when the answer comes
    # the whole GPU is hers again for a server
    hub.stop_server("alice")
    hub.start_server("alice", profile="gpu-1")

    before = alice.get("/users/alice/jobs").json()["runs"]
    for bad, field in (
        ({**body, "owner": "bob"}, "owner"),
        ({**body, "profile": "gpu-nope"}, "profile"),
        ({**body, "path": "/etc/passwd"}, "path"),
        ({**body, "environment": {"CUDA_VISIBLE_DEVICES": "0"}}, "environment"),
        ({**body, "max_retries": 99}, "max_retries"),
        ({**body, "profile": "gpu-8"}, "profile"),  # larger than this machine
    ):
        r = alice.post("/users/alice/jobs", json=bad)
        assert r.status_code in (400, 403), (bad, r.text)
        assert r.json()["message"].startswith(f"{field}"), (bad, r.text)
    assert alice.get("/users/alice/jobs").json()["runs"] == before  # nothing half-made


def test_a_running_job_survives_a_hub_restart_and_the_first_spawn_after_it(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    gate = hub.home("alice") / "go"
    put(
        hub,
        "alice",
        "gate.py",
        "import os, time\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.1)\n"
        "print('went on', flush=True)\n",
    )
    hub.stop_server("alice")
    alice = user_client(hub, "alice")
    r = alice.post(
        "/users/alice/jobs",
        json={"name": "gated", "kind": "script", "path": "gate.py", "profile": "gpu-half"},
    )
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    until(alice, f"/users/alice/jobs/{run_id}", "running")

    hub.stop_hub()
    hub.start()
    # the first spawn after a restart reconciles allocations with what runs: the job's share is
    # not a server's, and must stay
    hub.start_server("alice", profile="gpu-quarter")
    assert f"alice/job-{run_id}" in hub.allocations(), hub.log()[-3000:]
    gate.write_text("")
    alice = user_client(hub, "alice")
    done = until(alice, f"/users/alice/jobs/{run_id}", "succeeded", "failed")
    assert done["state"] == "succeeded", (done, hub.log()[-3000:])
    logs = alice.get(f"/users/alice/jobs/{run_id}/logs").json()
    assert logs["data"] == "went on\n"
    assert f"alice/job-{run_id}" not in hub.allocations()


def sse_events(client: httpx.Client, path: str, **headers: str) -> list[tuple[str, str, str]]:
    """(event, id, data) of one stream, read to its end."""
    events, event, ident, data = [], "message", "", ""
    with client.stream("GET", path, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("id: "):
                ident = line.removeprefix("id: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
            elif line == "" and data:
                events.append((event, ident, data))
                event, ident, data = "message", "", ""
    return events


def test_the_log_streams_live_as_server_sent_events_and_resumes_from_last_event_id(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    put(
        hub,
        "alice",
        "steps.py",
        "import time\nfor i in range(5):\n    print('step', i, flush=True)\n    time.sleep(0.3)\n",
    )
    hub.stop_server("alice")
    alice = user_client(hub, "alice")
    body = {"name": "steps", "kind": "script", "path": "steps.py", "profile": "gpu-eighth"}
    run_id = alice.post("/users/alice/jobs", json=body).json()["id"]
    path = f"/users/alice/jobs/{run_id}/logs/stream"
    events = sse_events(alice, path)  # from before it runs to its end
    *pieces, end = events
    assert end[0] == "end" and json.loads(end[2])["state"] == "succeeded"
    text = "".join(json.loads(data)["data"] for _event, _id, data in pieces)
    assert text == "".join(f"step {i}\n" for i in range(5))
    assert len(pieces) > 1  # it came as it was written, not at the end
    # a reconnect after "step 0\n" (EventSource's Last-Event-ID) gets the rest, exactly
    again = sse_events(alice, path, **{"Last-Event-ID": "1:7"})
    rest = "".join(json.loads(d)["data"] for e, _i, d in again if e == "message")
    assert rest == "".join(f"step {i}\n" for i in range(1, 5))
    assert alice.get(path, headers={"Last-Event-ID": "x"}).status_code == 400


def test_an_on_demand_server_preempts_a_preemptible_job_which_then_resumes_from_its_checkpoint(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="cpu")
    put(hub, "alice", "long.py", CHECKPOINTING_SCRIPT)
    hub.stop_server("alice")
    alice = user_client(hub, "alice")
    r = alice.post(
        "/users/alice/jobs",
        json={
            "name": "spot",
            "kind": "script",
            "path": "long.py",
            "profile": "gpu-1",
            "preemptible": True,
        },
    )
    assert r.status_code == 201, r.text
    path = f"/users/alice/jobs/{r.json()['id']}"
    until(alice, path, "running")
    time.sleep(1)  # some steps done

    # bob's on-demand whole GPU: the machine's only GPU is the job's, which gives way
    hub.start_server("bob", profile="gpu-1")
    assert [a for a in hub.allocations() if a.startswith(("alice/", "bob/"))] == ["bob/"]
    run = alice.get(path).json()
    assert run["state"] == "queued", run  # preempted, and queued again at once
    first = run["attempts"][0]
    assert first["state"] == "preempted" and "bob/" in first["reason"], first
    assert run["queue_position"] == 1, run
    deadline = time.monotonic() + 30
    while (run := alice.get(path).json())["waiting_reason"] == NOT_YET_CONSIDERED:
        assert time.monotonic() < deadline, run
        time.sleep(0.3)  # the next admission pass says why it waits
    assert run["waiting_reason"].startswith("waiting for a free"), run

    hub.stop_server("bob")
    again = until(alice, path, "running")
    assert len(again["attempts"]) == 2
    deadline = time.monotonic() + 30
    while not (logs := alice.get(f"{path}/logs").json())["data"] and time.monotonic() < deadline:
        time.sleep(0.3)
    resumed = int(logs["data"].split()[-1])  # this attempt's log: "resumed from <steps>"
    assert resumed > 0, logs
    assert alice.delete(path).json()["state"] == "canceled"


def test_a_running_job_outlives_the_culling_of_its_owners_idle_server(make_hub: Any) -> None:
    hub = make_hub(INVENTORY, env={"GPULAB_CULL_IDLE_SECONDS": "4"})
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    gate = hub.home("alice") / "go"
    put(
        hub,
        "alice",
        "gate.py",
        f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.1)\n"
        "print('went on', flush=True)\n",
    )
    alice = user_client(hub, "alice")
    r = alice.post(
        "/users/alice/jobs",
        json={"name": "gated", "kind": "script", "path": "gate.py", "profile": "gpu-quarter"},
    )
    assert r.status_code == 201, r.text
    path = f"/users/alice/jobs/{r.json()['id']}"
    until(alice, path, "running")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and hub.server_model("alice") is not None:
        time.sleep(0.5)
    assert "Culling server alice (inactive for" in hub.log()  # her idle server is gone
    assert alice.get(path).json()["state"] == "running"  # her job is not
    gate.write_text("")
    done = until(alice, path, "succeeded", "failed")
    assert done["state"] == "succeeded", done
    assert alice.get(f"{path}/logs").json()["data"] == "went on\n"
