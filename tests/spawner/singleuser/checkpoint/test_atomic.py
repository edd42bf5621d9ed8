"""Killing a real process in the middle of a save never leaves a broken checkpoint: SIGKILL keeps
the previous one, SIGTERM lets the save finish, saves the final state, then exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpulab.spawner.singleuser.checkpoint.saver import NamespaceCheckpointer
from gpulab.spawner.singleuser.checkpoint.store import CheckpointStore
from tests.harness.checkpoint import key_file_for, key_for

# The child saves v1, then starts saving v2 with one step made slow, announcing "MID" when it
# gets there, so that the test kills it at a known point of the save.
CHILD = """
import sys, time
import numpy as np
from pathlib import Path
from gpulab.spawner.singleuser.checkpoint import blobs, saver, store as store_mod
from gpulab.spawner.singleuser.checkpoint.saver import NamespaceCheckpointer
from gpulab.spawner.singleuser.checkpoint.store import CheckpointStore

where = sys.argv[2]
store = CheckpointStore(Path(sys.argv[1]), bytes.fromhex(sys.argv[3]), "alice")
cp = NamespaceCheckpointer(store)
cp.save({"a": np.full(1_000_000, 1.0), "b": "v1"}, exact=True)

def pause():
    print("MID", flush=True)
    time.sleep(30)

if where == "blob":  # after the first new blob is complete, before the next one
    real = saver.write_blob
    def slow(*args, **kw):
        out = real(*args, **kw)
        pause()
        return out
    saver.write_blob = slow
elif where == "blob-data":  # in the middle of writing a blob's data
    real_write = blobs._write_all
    def slow_write(fd, view):
        if len(view) > 1_000_000:  # the array's data
            blobs.os.write(fd, view[: len(view) // 2])
            pause()
        real_write(fd, view)
    blobs._write_all = slow_write
elif where == "manifest":  # the new manifest's temporary file is written, not yet renamed
    real_rename = store_mod.os.rename
    def slow_rename(src, dst):
        if str(dst).endswith("manifest.json"):
            pause()
        real_rename(src, dst)
    store_mod.os.rename = slow_rename
cp.save({"a": np.full(1_000_000, 2.0), "b": "v2", "c": list(range(1000))}, exact=True)
"""


@pytest.mark.parametrize("where", ["blob", "blob-data", "manifest"])
def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    path = tmp_path / "ckpt" / "default"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), where, key_for("alice").hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "MID"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(10)

    store = CheckpointStore(path, key_for("alice"), "alice")
    ns: dict = {}
    NamespaceCheckpointer(store).restore(ns)
    assert ns["b"] == "v1" and "c" not in ns
    np.testing.assert_array_equal(ns["a"], np.full(1_000_000, 1.0))
    # the half-written leftovers do not get in the way of the next save, which collects them
    cp = NamespaceCheckpointer(store)
    cp.save({"b": "v3"}, exact=True)
    assert [p.name for p in store.blobs.iterdir()] == [store.read_manifest().variables["b"].blob]


# A real IPython shell with the extension: a post-cell save (synchronous without an event loop)
# is slowed down; SIGTERM arrives during it.
SHELL_CHILD = """
import time
from IPython.core.interactiveshell import InteractiveShell
from gpulab.spawner.singleuser.checkpoint import saver

real = saver.write_blob
def slow(*args, **kw):
    out = real(*args, **kw)
    print("MID", flush=True)
    time.sleep(3)
    return out
shell = InteractiveShell.instance()
shell.run_cell("%load_ext gpulab.spawner.singleuser.checkpoint.kernel")
shell.run_cell("import numpy as np; a = np.zeros(10)")
saver.write_blob = slow
shell.run_cell("a = np.full(10, 2.0); b = 'during'; c = [1]")  # the save after this is slow
"""


def test_sigterm_during_a_save_finishes_it_saves_the_final_state_and_exits(tmp_path):
    root = tmp_path / "ckpt"
    env = dict(
        os.environ,
        GPULAB_CHECKPOINT_DIR=str(root),
        GPULAB_CHECKPOINT_KEY_FILE=str(key_file_for(tmp_path, "alice")),
        GPULAB_CHECKPOINT_USER="alice",
        IPYTHONDIR=str(tmp_path / "ipython"),
    )
    child = subprocess.Popen(
        [sys.executable, "-c", SHELL_CHILD], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        line = ""
        while line.strip() != "MID":
            line = child.stdout.readline()
            assert line, "child exited before the save"
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()

    store = CheckpointStore(root / "default", key_for("alice"), "alice")
    ns: dict = {}
    NamespaceCheckpointer(store).restore(ns)
    assert ns["b"] == "during" and ns["c"] == [1]
    np.testing.assert_array_equal(ns["a"], np.full(10, 2.0))


def test_a_manifest_names_only_complete_blobs(tmp_path):
    store = CheckpointStore(tmp_path / "s", key_for("alice"), "alice")
    NamespaceCheckpointer(store).save({"x": np.arange(5), "y": {"k": "v"}}, exact=True)
    m = store.read_manifest()
    for entry in m.variables.values():
        assert (store.blobs / entry.blob).stat().st_size == entry.size
    assert not list(Path(store.blobs).glob("*.tmp"))
