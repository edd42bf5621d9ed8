"""The sweep of what killed test runs left (tests/harness/leftovers.py), on real processes and a
real system account: a dead owner's hub processes (each in a session of its own, as the hub and
its proxy are), account processes, account and directory go; a live owner's stay, and so does a
process carrying another directory's marker."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.harness import leftovers
from tests.harness.accounts import TestAccounts, pids_of_uid


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def as_dead_owner(folder: Path) -> None:
    owner = json.loads((folder / leftovers.OWNER_FILE).read_text())
    owner["pid"] = dead_pid()
    (folder / leftovers.OWNER_FILE).write_text(json.dumps(owner))


STARTED: list[subprocess.Popen[bytes]] = []


def sleeper(marker: str, *, user: int | None = None) -> subprocess.Popen[bytes]:
    name, value = marker.split("=", 1)
    proc = subprocess.Popen(
        ["sleep", "600"], env={**os.environ, name: value}, start_new_session=True, user=user
    )
    STARTED.append(proc)
    return proc


def test_a_dead_owners_hub_accounts_and_folder_are_removed_and_a_live_owners_kept() -> None:
    root = Path(tempfile.mkdtemp(prefix="leftovers-"))
    accounts = TestAccounts()
    try:
        account = accounts.make("alice")
        theirs = sleeper("X=1", user=account.uid)  # her kernel, say
        dead, alive = root / "dead", root / "alive"
        for folder in (dead, alive):
            folder.mkdir()
        leftovers.claim(dead, account_prefix=accounts.prefix, marker=f"GPULAB_CONFIG={dead}/c")
        hub, proxy = sleeper(f"GPULAB_CONFIG={dead}/c"), sleeper(f"GPULAB_CONFIG={dead}/c")
        as_dead_owner(dead)
        leftovers.claim(alive, account_prefix="gtnone-", marker=f"GPULAB_CONFIG={alive}/c")
        kept = sleeper(f"GPULAB_CONFIG={alive}/c")
        stranger = sleeper(f"GPULAB_CONFIG={dead}/c.other")

        assert leftovers.sweep(root) == ["dead"]
        assert hub.wait(10) == -9 and proxy.wait(10) == -9
        assert theirs.wait(10) == -9
        assert pids_of_uid(account.uid) == []
        assert account.name not in {e.pw_name for e in pwd.getpwall()}
        assert sorted(p.name for p in root.iterdir()) == ["alive"]
        time.sleep(0.2)
        assert kept.poll() is None and stranger.poll() is None
        # the owner of a folder is this process: a second sweep takes nothing
        assert leftovers.sweep(root) == []
    finally:
        for proc in STARTED:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        accounts.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_folder_without_an_owner_file_is_left_alone() -> None:
    root = Path(tempfile.mkdtemp(prefix="leftovers-"))
    try:
        (root / "being-made").mkdir()
        assert leftovers.sweep(root) == []
        assert (root / "being-made").is_dir()
    finally:
        shutil.rmtree(root, ignore_errors=True)
