"""`gpulab job` against a real hub with a user's token: submit a notebook with JSON parameters
and follow its per-cell progress to the end, list, show, logs, cancel, and errors that say
what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import nbformat

from tests.harness.hub import Hub
from tests.harness.jobs import INVENTORY, put

GPULAB = [sys.executable, "-m", "gpulab.hub.cli"]


def user_token(hub: Hub, user: str) -> str:
    r = hub.api("POST", f"/users/{user}/tokens", json={"note": "cli"})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def job(hub: Hub, token: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPULAB_"))}
    env.update(GPULAB_HUB_URL=hub.url, GPULAB_TOKEN=token)
    return subprocess.run(
        [*GPULAB, "job", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def notebook() -> str:
    nb = nbformat.v4.new_notebook()
    parameters = nbformat.v4.new_code_cell("lr = 0.1\nepochs = 1")
    parameters.metadata["tags"] = ["parameters"]
    nb.cells = [
        parameters,
        nbformat.v4.new_code_cell("print('lr', lr, 'epochs', epochs)"),
        nbformat.v4.new_code_cell("result = lr * epochs"),
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return str(nbformat.writes(nb))


def test_a_notebook_job_from_the_command_line(make_hub: Any) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    put(hub, "alice", "nb/train.ipynb", notebook())
    put(hub, "alice", "nap.py", "import time\ntime.sleep(600)\n")
    hub.stop_server("alice")
    token = user_token(hub, "alice")

    out = job(
        hub, token, "submit", "nb/train.ipynb", "--profile", "gpu-quarter",
        "-p", "lr=0.001", "-p", "epochs=3", "--follow",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("run ") and lines[0].endswith(": queued (gpu-quarter)")
    assert "lr 0.001 epochs 3" in out.stdout  # the JSON parameters, typed
    assert any(line.startswith("[cell 3/4]") for line in lines), out.stdout  # 4: + injected
    assert lines[-1].endswith(": succeeded")
    run_id = lines[0].split()[1].rstrip(":")
    executed = nbformat.read(hub.home("alice") / "gpulab-jobs" / "train" / f"run-{run_id}" /
                             "train.ipynb", as_version=4)  # fmt: skip
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)

    shown = json.loads(job(hub, token, "show", run_id).stdout)
    assert shown["state"] == "succeeded" and shown["spec"]["parameters"] == {
        "lr": 0.001,
        "epochs": 3,
    }
    nap = job(hub, token, "submit", "nap.py", "--profile", "gpu-1")
    assert nap.returncode == 0, nap.stderr
    nap_id = nap.stdout.split()[1].rstrip(":")
    listed = job(hub, token, "list").stdout.splitlines()
    assert [line.split()[0] for line in listed] == [nap_id, run_id]
    canceled = job(hub, token, "cancel", nap_id)
    assert canceled.returncode == 0 and canceled.stdout.strip() == f"run {nap_id}: canceled"

    refused = job(hub, token, "submit", "nap.py", "--profile", "gpu-8")
    assert refused.returncode == 1
    assert refused.stderr.startswith("gpulab job: 400: profile: gpu-8 is larger than any machine")
    no_token = job(hub, "", "list")
    assert no_token.returncode == 1 and "no token" in no_token.stderr
    bad = job(hub, token, "submit", "nap.py", "--profile", "gpu-1", "-e", "NOEQUALS")
    assert bad.returncode == 1 and "--env: expected NAME=VALUE" in bad.stderr


def test_a_list_into_a_pipe_whose_reader_has_gone_ends_quietly(make_hub: Any) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    put(hub, "alice", "nap.py", "import time\ntime.sleep(600)\n")
    hub.stop_server("alice")
    token = user_token(hub, "alice")
    submitted = job(hub, token, "submit", "nap.py", "--profile", "gpu-1")
    assert submitted.returncode == 0, submitted.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPULAB_"))}
    env.update(GPULAB_HUB_URL=hub.url, GPULAB_TOKEN=token)
    # `gpulab job list | head -0`: the reader is gone before the list is written
    reader, writer = os.pipe()
    os.close(reader)
    try:
        listed = subprocess.run(
            [*GPULAB, "job", "list"],
            env=env,
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(writer)
    assert listed.stderr == ""  # no BrokenPipeError traceback
    assert listed.returncode == 128 + 13  # what a shell reports for a command ended by SIGPIPE
    run_id = submitted.stdout.split()[1].rstrip(":")
    assert job(hub, token, "cancel", run_id).returncode == 0
