"""Starts that cannot succeed say why: a hub whose users could not reach their homes refuses to
start, and a server that dies before it is ready fails its start at once with the reason (never
JupyterHub 6's uncaught 500 after the slow-spawn timeout)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from traitlets.config import Config

from gpulab.hub.state_dir import untraversable_ancestors


def test_a_hub_whose_homes_lie_under_a_directory_users_cannot_pass_refuses_to_start(make_hub):
    hub = make_hub(start=False)
    # as a state directory made inside `mktemp -d` (0700 root) would be
    private = hub.state_dir / "private"
    (private / "state").mkdir(parents=True)
    os.chmod(private, 0o700)
    hub.overlay_path.write_text(
        hub.overlay_path.read_text() + f"c.GPUSimpleLocalSpawner.home_dir_template = "
        f"{str(private / 'state' / 'homes' / '{username}' / '{servername}')!r}\n"
    )
    hub.start(expect_failure=True)
    assert hub.wait_exit() != 0
    log = hub.log()
    assert "gpulab configuration error: user accounts cannot reach their homes under " in log
    assert f"other accounts may not pass through {private} (mode 0700)" in log
    assert f"Run `chmod o+x {private}`" in log


def test_a_server_whose_home_cannot_be_made_fails_its_start_with_the_reason(make_hub):
    hub = make_hub()
    hub.create_user("alice")
    # her account can no longer pass through the homes' directory (as under a 0700 parent)
    (hub.state_dir / "homes").mkdir(mode=0o700)
    r = hub.spawn("alice", profile="cpu")
    assert r.status_code == 500, r.text
    message = r.json()["message"]
    assert message.startswith("alice's server exited with status 1 before it was ready: ")
    assert f"cannot prepare the home {hub.home('alice')} as {hub.account_prefix}alice" in message
    assert "Permission denied" in message
    model = hub.server_model("alice")
    assert model is None or not model.get("pending"), model
    assert hub.allocations() == {}


def test_a_server_that_exits_on_its_own_before_it_is_ready_fails_its_start_with_its_status(
    make_hub,
):
    exits = [sys.executable, "-c", "import sys; sys.exit(3)"]
    hub = make_hub(Config(Spawner={"cmd": exits}))
    hub.create_user("alice")
    r = hub.spawn("alice", "train", profile="cpu")
    assert r.status_code == 500, r.text
    assert r.json()["message"] == (
        "alice's server 'train' exited with status 3 before it was ready: its output is in the "
        "hub's log"
    )
    assert hub.allocations() == {}


def test_untraversable_ancestors_follow_links_and_stop_at_missing_directories():
    # not under pytest's tmp_path, whose own ancestors are 0700
    root = Path(tempfile.mkdtemp())
    try:
        os.chmod(root, 0o711)
        closed = root / "closed"
        (closed / "inner").mkdir(parents=True)
        os.chmod(closed, 0o700)
        link = root / "link"
        link.symlink_to(closed / "inner")
        assert untraversable_ancestors(link / "homes") == [closed]
        assert untraversable_ancestors(root / "open" / "homes") == []
    finally:
        shutil.rmtree(root)
