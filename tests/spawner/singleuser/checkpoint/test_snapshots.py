"""Home-volume snapshots: hard-link increments, whole restores and clones, retention, privacy."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from gpulab.spawner.singleuser.checkpoint import snapshots as snaps
from gpulab.spawner.singleuser.checkpoint.snapshots import SnapshotError


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "homes" / "alice"
    (h / "project" / "data").mkdir(parents=True)
    (h / "project" / "train.py").write_text("print('train')\n")
    (h / "project" / "data" / "big.bin").write_bytes(os.urandom(1 << 20))
    (h / "notes.md").write_text("v1\n")
    os.chmod(h / "notes.md", 0o640)
    (h / "latest").symlink_to("project/train.py")
    (h / ".local" / "lib").mkdir(parents=True)
    return h


def _tree(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir", stat.S_IMODE(p.stat().st_mode))
        else:
            out[rel] = ("file", p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
    return out


def test_snapshot_copies_the_home_exactly(home, tmp_path):
    s = snaps.snapshot(home, tmp_path / "store", "on-stop")
    assert _tree(s.tree) == _tree(home)
    assert s.label == "on-stop" and s.files == 3 and s.new_bytes == s.bytes
    assert snaps.list_snapshots(tmp_path / "store") == [s]


def test_unchanged_files_are_hard_linked_to_the_previous_snapshot(home, tmp_path):
    store = tmp_path / "store"
    first = snaps.snapshot(home, store, "a")
    (home / "notes.md").write_text("v2, longer\n")
    second = snaps.snapshot(home, store, "b")
    big = "project/data/big.bin"
    assert (first.tree / big).stat().st_ino == (second.tree / big).stat().st_ino
    assert (first.tree / "notes.md").stat().st_ino != (second.tree / "notes.md").stat().st_ino
    assert (first.tree / "notes.md").read_text() == "v1\n"
    assert second.new_bytes == len("v2, longer\n")
    # the home never shares an inode with a snapshot: editing it cannot alter one
    assert (home / big).stat().st_ino != (second.tree / big).stat().st_ino


def test_restore_swaps_in_the_whole_snapshot_and_keeps_the_state_it_replaced(home, tmp_path):
    store = tmp_path / "store"
    s = snaps.snapshot(home, store, "good")
    expected = _tree(home)
    (home / "notes.md").write_text("broken\n")
    (home / "project" / "train.py").unlink()
    (home / "junk.txt").write_text("new since")
    before = snaps.restore(s, home)
    assert _tree(home) == expected
    assert before is not None and before.label == "before-restore"
    assert (before.tree / "junk.txt").read_text() == "new since"
    assert [p.name for p in home.parent.iterdir()] == ["alice"]  # no staging left behind


def test_a_failed_restore_leaves_the_home_untouched(home, tmp_path, monkeypatch):
    s = snaps.snapshot(home, tmp_path / "store", "good")
    (home / "notes.md").write_text("current\n")
    expected = _tree(home)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(snaps, "_copy_file", boom)
    with pytest.raises(OSError, match="disk full"):
        snaps.restore(s, home, keep_current=False)
    assert _tree(home) == expected
    assert [p.name for p in home.parent.iterdir()] == ["alice"]


def test_clone_makes_an_independent_new_home(home, tmp_path):
    s = snaps.snapshot(home, tmp_path / "store", "base")
    new = snaps.clone(s, tmp_path / "homes" / "alice-experiment")
    assert _tree(new) == _tree(s.tree)
    (new / "notes.md").write_text("changed in the clone\n")
    assert (s.tree / "notes.md").read_text() == "v1\n"
    with pytest.raises(SnapshotError, match="already exists"):
        snaps.clone(s, new)


def test_retention_keeps_the_last_n_and_the_newest_of_each_recent_day(home, tmp_path):
    store = tmp_path / "store"
    day = 86400
    # noon UTC: the ages below must not cross midnight, whatever time the test runs
    now = (time.time() // day) * day + day / 2
    made = []
    for age_days, label in [
        (9, "old"),
        (3.2, "d3-early"),
        (3.1, "d3-late"),
        (1, "d1"),
        (0.2, "t1"),
        (0.1, "t2"),
    ]:
        s = snaps.snapshot(home, store, label)
        meta = json.loads((s.path / "snapshot.json").read_text())
        meta["created"] = now - age_days * day
        (s.path / "snapshot.json").write_text(json.dumps(meta))
        made.append(label)
    deleted = snaps.apply_retention(store, keep_last=2, keep_daily=7, now=now)
    kept = [s.label for s in snaps.list_snapshots(store)]
    assert sorted(s.label for s in deleted) == ["d3-early", "old"]
    assert kept == ["d3-late", "d1", "t1", "t2"]
    # deleting a snapshot never breaks another that shares its files
    for s in snaps.list_snapshots(store):
        assert (s.tree / "project" / "data" / "big.bin").stat().st_size == 1 << 20


def test_snapshots_are_private_and_outside_the_home(home, tmp_path):
    store = tmp_path / "store"
    s = snaps.snapshot(home, store, "x")
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert stat.S_IMODE(s.path.stat().st_mode) == 0o700
    with pytest.raises(SnapshotError, match="must not be inside the home"):
        snaps.snapshot(home, home / ".snapshots", "x")


def test_an_interrupted_snapshot_is_invisible_and_cleaned_up(home, tmp_path):
    store = tmp_path / "store"
    snaps.snapshot(home, store, "ok")
    (store / ".tmp-20260101T000000.000000Z-crashed-abc").mkdir()
    assert [s.label for s in snaps.list_snapshots(store)] == ["ok"]
    snaps.snapshot(home, store, "next")
    assert not list(store.glob(".tmp-*"))


def test_clone_into_a_new_named_server_moves_its_kernel_checkpoints(home, tmp_path):
    (home / ".gpulab" / "checkpoints" / "default" / "nb").mkdir(parents=True)
    (home / ".gpulab" / "checkpoints" / "default" / "nb" / "manifest.json").write_text("m")
    s = snaps.snapshot(home, tmp_path / "store", "base")
    new = snaps.clone(s, tmp_path / "homes" / "alice-exp", rename_server=("", "exp"))
    assert (new / ".gpulab" / "checkpoints" / "exp" / "nb" / "manifest.json").read_text() == "m"
    assert not (new / ".gpulab" / "checkpoints" / "default").exists()


def test_retention_keeps_everything_while_there_are_fewer_than_keep_last(tmp_path):
    home, store = tmp_path / "home", tmp_path / "store"
    home.mkdir()
    (home / "a").write_text("1")
    for _ in range(3):
        snaps.snapshot(home, store, "on-stop")
        assert snaps.apply_retention(store, keep_last=5, keep_daily=0) == []
    assert len(snaps.list_snapshots(store)) == 3
