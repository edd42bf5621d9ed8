"""The GPU summary JupyterHub's own admin page shows in a server's expanded row
(`user_options["gpulab"]`, gpulab.spawner.gpu_summary): its wording, and on a real hub that it
is there while the server runs, survives a hub restart and is never kept as a user's choice."""

from __future__ import annotations

import json
import sqlite3
from types import SimpleNamespace

from traitlets.config import Config

from gpulab.spawner.gpu_summary import gpu_label, without_gpu_summary

A100 = SimpleNamespace(model="A100-SXM4-80GB", mig_profile=None)
MIG = SimpleNamespace(model="A100-SXM4-80GB", mig_profile="3g.40gb")


def test_the_gpu_label_reads_as_a_share_of_a_model():
    assert gpu_label([(250, A100)]) == "1/4 A100-SXM4-80GB"
    assert gpu_label([(125, A100)]) == "1/8 A100-SXM4-80GB"
    assert gpu_label([(1000, A100)]) == "1 A100-SXM4-80GB"
    assert gpu_label([(1000, A100), (1000, A100)]) == "2 x A100-SXM4-80GB"
    assert gpu_label([(500, MIG)]) == "MIG 3g.40gb of A100-SXM4-80GB"
    assert gpu_label([]) == "none"


def test_without_gpu_summary_drops_only_the_summary():
    options = {"profile": "gpu-1", "gpulab": {"gpu": "1 A100"}}
    assert without_gpu_summary(options) == {"profile": "gpu-1"}
    plain = {"profile": "gpu-1"}
    assert without_gpu_summary(plain) is plain


def _stored_user_options(hub, user: str) -> dict:
    """What JupyterHub's database keeps as the server's options (the next start's default)."""
    db = sqlite3.connect(hub.state_dir / "jupyterhub.sqlite")
    try:
        (raw,) = db.execute(
            "SELECT s.user_options FROM spawners s JOIN users u ON s.user_id = u.id "
            "WHERE u.name = ? AND s.name = ''",
            (user,),
        ).fetchone()
    finally:
        db.close()
    return json.loads(raw) if isinstance(raw, str) else raw


def test_the_stock_admin_page_sees_a_gpu_summary_in_the_servers_user_options(make_hub):
    hub = make_hub(Config(GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"}))
    hub.create_user("alice")
    hub.start_server("alice", profile="gpu-quarter")
    overview = hub.api("GET", "/gpulab/admin/overview").json()
    (workload,) = [w for w in overview["workloads"] if w["id"] == "alice/"]
    (device,) = workload["devices"]
    summary = hub.server_model("alice")["user_options"]["gpulab"]
    assert summary == {
        "profile": "gpu-quarter",
        "gpu": "1/4 A100-SXM4-80GB",
        "node": workload["node"],
        "devices": [f"GPU {device['index']}: {device['uuid']}"],
        "tier": "on-demand",
    }
    # the summary is the hub's: the database keeps the user's choice only
    assert _stored_user_options(hub, "alice") == {"profile": "gpu-quarter"}

    # after a hub restart (the server runs on), it is built again from the placement
    hub.stop_hub()
    hub.start()
    assert hub.server_model("alice")["user_options"]["gpulab"] == summary

    # a client that copies the options it read into the next start: the copy is no option
    hub.stop_server("alice")
    r = hub.spawn("alice", profile="gpu-half", gpulab=summary)
    assert r.status_code in (201, 202), r.text
    model = hub.wait_ready("alice")
    assert model["user_options"]["gpulab"]["gpu"] == "1/2 A100-SXM4-80GB"
    assert model["user_options"]["profile"] == "gpu-half"
    assert _stored_user_options(hub, "alice") == {"profile": "gpu-half"}
    hub.stop_server("alice")
