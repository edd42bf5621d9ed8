"""GPU jobs from the lab, through a real hub and real servers, without a browser: jupyter-scheduler's
REST API in a user's server hands runs to the hub's job service (gpulab's backend), the jobs
panel's API relays them and their live log, and a server's own token reaches its owner's runs and
nobody else's."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
from traitlets.config import Config

from tests.harness.hub import Hub, merged, run_in_kernel
from tests.harness.jobs import INVENTORY, put
from tests.harness.labserver import EXTENSION_SRC


def lab_overlay() -> Config:
    """Servers importing the extension from its source (its link hook makes gpulab's backend
    jupyter-scheduler's default)."""
    overlay = Config()
    overlay.Spawner.environment.update({"PYTHONPATH": str(EXTENSION_SRC)})
    return merged(INVENTORY, overlay)


def hub_client(hub: Hub, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"{hub.url}/hub/api/gpulab",
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )


def test_a_servers_token_reaches_its_owners_jobs_and_nobody_elses(make_hub: Any) -> None:
    hub = make_hub(lab_overlay())
    for user in ("alice", "bob"):
        hub.create_user(user)
        hub.start_server(user, profile="cpu")
        put(hub, user, "nap.py", "import time\ntime.sleep(600)\n")
    alice = hub_client(hub, hub.server_env("alice")["JUPYTERHUB_API_TOKEN"])
    bob = hub_client(hub, hub.server_env("bob")["JUPYTERHUB_API_TOKEN"])
    # bob's job takes the hub's one GPU, so alice's waits, and her lab says where and why
    nap = {"name": "nap", "kind": "script", "path": "nap.py", "profile": "gpu-1"}
    r = bob.post("/users/bob/jobs", json=nap)
    assert r.status_code == 201, r.text
    bob_run = r.json()["id"]
    deadline = time.monotonic() + 60
    while bob.get(f"/users/bob/jobs/{bob_run}").json()["state"] != "running":
        assert time.monotonic() < deadline, hub.log()[-3000:]
        time.sleep(0.3)
    body = {**nap, "profile": "gpu-quarter"}
    r = alice.post("/users/alice/jobs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    # queued before the next admission pass has looked at it: it says so, never nothing
    assert r.json()["waiting_reason"], r.json()
    deadline = time.monotonic() + 30
    while True:  # the admission pass gives its verdict asynchronously
        (listed,) = alice.get("/users/alice/jobs").json()["runs"]
        if listed["waiting_reason"] == "waiting for a free 1/4 GPU":
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
    assert listed["id"] == run_id and listed["queue_position"] == 1, listed
    lab = httpx.Client(
        base_url=f"{hub.url}/user/alice",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )
    job = lab.get(f"/scheduler/jobs/gpulab-{run_id}").json()
    assert job["status"] == "QUEUED"
    assert job["status_message"] == f"queued, position 1: {listed['waiting_reason']}"
    # bob's server token: nothing of alice's, read or write
    assert bob.get("/users/alice/jobs").status_code == 403
    assert bob.post("/users/alice/jobs", json=body).status_code == 403
    assert bob.get(f"/users/alice/jobs/{run_id}").status_code == 403
    assert bob.get(f"/users/alice/jobs/{run_id}/logs").status_code == 403
    assert bob.get(f"/users/alice/jobs/{run_id}/logs/stream").status_code == 403
    assert bob.delete(f"/users/alice/jobs/{run_id}").status_code == 403
    assert alice.get(f"/users/alice/jobs/{run_id}").json()["state"] == "queued"
    # nor hers his: her token is hers alone, and his run ids are not found under her name
    assert alice.delete(f"/users/bob/jobs/{bob_run}").status_code == 403
    assert alice.get(f"/users/alice/jobs/{bob_run}").status_code == 404
    r = alice.delete(f"/users/alice/jobs/{run_id}")
    assert r.status_code == 200 and r.json()["state"] == "canceled"
    assert bob.delete(f"/users/bob/jobs/{bob_run}").json()["state"] == "canceled"


def notebook() -> str:
    import nbformat

    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("lr = 0.1")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        params,
        nbformat.v4.new_code_cell(
            "import os\nprint('training with lr', lr, flush=True)\n"
            "open(os.path.join(os.environ['GPULAB_OUTPUT_DIR'], 'model.txt'), 'w').write('ok')"
        ),
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return str(nbformat.writes(nb))


def test_jupyter_schedulers_api_in_the_lab_runs_a_notebook_as_a_hub_job(
    make_hub: Any, tmp_path: Path
) -> None:
    hub = make_hub(lab_overlay())
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    put(hub, "alice", "projects/train.ipynb", notebook())
    lab = httpx.Client(
        base_url=f"{hub.url}/user/alice",
        headers={"Authorization": f"token {hub.token}"},
        timeout=60,
    )
    envs = lab.get("/scheduler/runtime_environments")
    assert envs.status_code == 200, envs.text
    (env,) = envs.json()
    assert env["name"] == "gpulab"
    quarter = next(t for t in env["compute_types"] if t.startswith("gpu-quarter | "))
    assert "free" in quarter and "GPU quota" in quarter  # live capacity and her quota
    r = lab.post(
        "/scheduler/jobs",
        json={
            "input_uri": "projects/train.ipynb",
            "runtime_environment_name": "gpulab",
            "name": "train",
            "compute_type": quarter,
            "parameters": {"lr": "0.001"},
            "output_formats": ["ipynb"],
        },
    )
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    assert job_id.startswith("gpulab-")
    run_id = int(job_id.removeprefix("gpulab-"))
    deadline = time.monotonic() + 120
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = lab.get(f"/scheduler/jobs/{job_id}").json()
        if job["status"] in ("COMPLETED", "FAILED", "STOPPED"):
            break
        time.sleep(0.5)
    assert job["status"] == "COMPLETED", (job, hub.log()[-3000:])
    assert job["compute_type"] == "gpu-quarter" and job["parameters"] == {"lr": "0.001"}
    files = {f["file_path"] for f in job["job_files"]}
    assert files == {
        f"gpulab-jobs/train/run-{run_id}/train.ipynb",
        f"gpulab-jobs/train/run-{run_id}/model.txt",
    }
    listed = lab.get("/scheduler/jobs").json()["jobs"]
    assert [j["job_id"] for j in listed] == [job_id]

    # the panel's API: the same run with its extras, and its log relayed as Server-Sent Events
    panel = lab.get("/gpulab/jobs").json()["runs"]
    assert panel[0]["id"] == run_id and panel[0]["state"] == "succeeded"
    one = lab.get(f"/gpulab/jobs/{run_id}").json()
    assert one["output_paths"] == sorted(files) and one["attempts"][0]["exit_code"] == 0
    assert panel[0]["tensorboard_url"].startswith("/user/alice/tensorboard/?runFilter=")
    events = lab.get(f"/gpulab/jobs/{run_id}/logs/stream").text
    data = "".join(
        json.loads(line[len("data: ") :]).get("data", "")
        for line in events.splitlines()
        if line.startswith("data: ")
    )
    assert "training with lr 0.001" in data and "event: end" in events
    # rerun from the panel, then stop it through jupyter-scheduler's API (a cancel in the hub)
    again = lab.post(f"/gpulab/jobs/{run_id}/rerun")
    assert again.status_code == 201, again.text
    again_id = f"gpulab-{again.json()['id']}"
    stop = lab.patch(f"/scheduler/jobs/{again_id}", json={"status": "STOPPED"})
    assert stop.status_code == 204, stop.text
    assert lab.get(f"/scheduler/jobs/{again_id}").json()["status"] == "STOPPED"
    # a profile the hub refuses: its message, naming the field, through jupyter-scheduler
    refused = lab.post(
        "/scheduler/jobs",
        json={
            "input_uri": "projects/train.ipynb",
            "runtime_environment_name": "gpulab",
            "name": "big",
            "compute_type": "gpu-8",
        },
    )
    assert refused.status_code == 500 and refused.json()["message"].startswith("profile:")
    assert lab.get("/gpulab/jobs/999999").status_code == 404

    # a script, from the lab's own "Submit as GPU job": profiles to pick from, then args
    choices = lab.get("/gpulab/jobs/profiles").json()
    assert "gpu-quarter" in [p["slug"] for p in choices["profiles"]] and choices["quota"]
    put(hub, "alice", "projects/run.py", "import sys\nprint('args', sys.argv[1:], flush=True)\n")
    script = {"path": "projects/run.py", "profile": "gpu-quarter", "args": ["--epochs", "3"]}
    r = lab.post("/gpulab/jobs", json=script)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["kind"] == "script" and r.json()["spec"]["name"] == "run"
    script_run = r.json()["id"]
    deadline = time.monotonic() + 60
    while lab.get(f"/gpulab/jobs/{script_run}").json()["state"] != "succeeded":
        assert time.monotonic() < deadline, lab.get(f"/gpulab/jobs/{script_run}").json()
        time.sleep(0.5)
    log = lab.get(f"/gpulab/jobs/{script_run}/logs/stream").text
    assert "args ['--epochs', '3']" in log
    for bad, field in (
        ({"path": "projects/run.py"}, "profile"),
        ({**script, "path": "../../etc/passwd"}, "path"),
        ({**script, "profile": "gpu-8"}, "profile"),  # the hub's refusal, passed on
        ({**script, "args": "--epochs 3"}, "args"),
    ):
        r = lab.post("/gpulab/jobs", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["message"].startswith(f"{field}"), (bad, r.text)

    # `%tensorboard` in her kernels goes through her server's proxy, behind its auth
    out = asyncio.run(
        run_in_kernel(hub, "alice", "import os; print(os.environ['TENSORBOARD_PROXY_URL'])")
    )
    assert out.strip() == "/user/alice/proxy/%PORT%/"
    # bob, with a token of his own, reaches neither her jobs through her server nor her TensorBoard
    hub.create_user("bob")
    r = hub.api("POST", "/users/bob/tokens", json={"note": "bob"})
    bob = httpx.Client(
        base_url=f"{hub.url}/user/alice",
        headers={"Authorization": f"token {r.json()['token']}"},
        timeout=30,
        follow_redirects=False,
    )
    for path in ("/gpulab/jobs", f"/gpulab/jobs/{run_id}/logs/stream", "/tensorboard/"):
        assert bob.get(path).status_code == 403, path
    assert bob.post(f"/gpulab/jobs/{run_id}/rerun").status_code == 403
    assert bob.post("/scheduler/jobs", json={}).status_code == 403
