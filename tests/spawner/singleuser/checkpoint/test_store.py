"""Namespace save/restore into a signed store, without a kernel: values, change detection,
signatures, permissions."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sqlite3
import stat
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from gpulab.spawner.singleuser.checkpoint import derive_user_key, describe, list_checkpoints
from gpulab.spawner.singleuser.checkpoint.saver import NamespaceCheckpointer
from gpulab.spawner.singleuser.checkpoint.signing import CheckpointRefused
from gpulab.spawner.singleuser.checkpoint.store import CURRENT, MAX_MANIFEST_BYTES, CheckpointStore
from tests.harness.checkpoint import HUB_SECRET, key_for


class Point:  # an importable class: pickled by reference
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def _roundtrip(store: CheckpointStore, ns: dict) -> tuple[dict, object]:
    NamespaceCheckpointer(store).save(ns, exact=True)
    fresh: dict = {}
    report = NamespaceCheckpointer(store).restore(fresh)
    return fresh, report


def test_arrays_of_every_layout_come_back_equal(store):
    rng = np.random.default_rng(0)
    c = rng.standard_normal((64, 33)).astype(np.float32)
    ns = {
        "c": c,
        "f": np.asfortranarray(rng.integers(0, 9, (7, 5))),
        "strided": c[::2, 1::3],
        "rec": np.array([(1, 2.5, b"ab")], dtype=[("i", "<i4"), ("x", "<f8"), ("s", "S2")]),
        "empty": np.zeros((0, 3)),
        "scalar": np.float64(3.5),
        "objs": np.array([{"a": 1}, None], dtype=object),
    }
    fresh, report = _roundtrip(store, ns)
    assert sorted(report.restored) == sorted(ns)
    for k, v in ns.items():
        assert fresh[k].dtype == v.dtype and fresh[k].shape == v.shape, k
        if v.dtype != object:
            np.testing.assert_array_equal(fresh[k], v)
        else:
            assert list(fresh[k]) == list(v)
    assert fresh["f"].flags.f_contiguous
    fresh["c"][0, 0] = 42  # restored arrays are writable
    assert fresh["c"][0, 0] == 42


def test_array_data_is_written_raw_not_pickled_in_band(store):
    a = np.arange(1_000_000, dtype=np.float64)
    NamespaceCheckpointer(store).save({"a": a}, exact=True)
    entry = store.read_manifest().variables["a"]
    assert entry.size < a.nbytes + 4096  # header + tiny pickle + raw buffer
    raw = (store.blobs / entry.blob).read_bytes()
    assert a.tobytes() in raw


def test_python_objects_functions_classes_and_modules(store):
    import collections

    code = "def area(r):\n    return PI * r * r\n\nclass Box:\n    def size(self):\n        return len(self.items)\n"
    user_ns: dict = {"__name__": "__main__"}
    exec(compile(code, "<cell>", "exec"), user_ns)
    for obj in (user_ns["area"], user_ns["Box"]):
        obj.__module__ = "__main__"
    box = user_ns["Box"]()
    box.items = [1, 2, 3]
    ns = {
        "PI": 3.0,
        "area": user_ns["area"],
        "Box": user_ns["Box"],
        "box": box,
        "square": lambda x: x * x,
        "nested": {"k": [1, (2, 3)], "s": {4}},
        "p": Point(1, 2),
        "counter": collections.Counter("abca"),
        "coll": collections,
        "text": "x" * 1000,
    }
    ns["square"].__module__ = "__main__"
    fresh, report = _roundtrip(store, ns)
    assert not report.failed
    assert fresh["coll"] is collections
    assert fresh["nested"] == ns["nested"] and fresh["p"] == Point(1, 2)
    assert fresh["counter"] == ns["counter"] and fresh["text"] == ns["text"]
    assert fresh["square"](4) == 16
    # a notebook function sees the namespace it was restored into, as if its cell ran again
    fresh["PI"] = 4.0
    assert fresh["area"](1) == 4.0
    assert fresh["box"].size() == 3
    manifest = store.read_manifest()
    assert manifest.modules == {"coll": "collections"}
    assert manifest.variables["area"].engine == "dill"
    assert manifest.variables["nested"].engine == "pickle"


def test_unpicklable_values_are_listed_and_the_rest_is_saved(store):
    gen = (i for i in range(3))
    conn = sqlite3.connect(":memory:")
    with open(__file__) as fh:
        ns = {"gen": gen, "conn": conn, "fh": fh, "ok": [1, 2]}
        report = NamespaceCheckpointer(store).save(ns, exact=True)
    assert report.committed
    assert set(report.unpicklable) == {"gen", "conn", "fh"}
    assert "reopen" in report.unpicklable["fh"]
    fresh: dict = {}
    restored = NamespaceCheckpointer(store).restore(fresh)
    assert fresh == {"ok": [1, 2]}
    assert set(restored.not_saved) == {"gen", "conn", "fh"}
    assert "gen" in restored.summary()


def test_same_object_under_two_names_is_saved_once_and_stays_shared(store):
    a = np.ones(1000)
    fresh, _ = _roundtrip(store, {"a": a, "b": a})
    assert fresh["a"] is fresh["b"]
    assert len(list(store.blobs.iterdir())) == 1


def test_nothing_changed_means_nothing_written(store):
    ns = {"a": np.arange(100), "s": "hello", "d": {"x": 1}}
    cp = NamespaceCheckpointer(store)
    assert cp.save(ns).committed
    before = (store.path / CURRENT).stat().st_mtime_ns
    report = cp.save(ns)
    assert not report.committed and report.skipped == "nothing changed"
    assert (store.path / CURRENT).stat().st_mtime_ns == before


def test_incremental_save_writes_only_changed_variables(store):
    ns = {"a": np.zeros(10_000), "b": np.ones(10_000), "d": {"n": 1}}
    cp = NamespaceCheckpointer(store)
    cp.save(ns)
    ns["b"] = ns["b"] * 2
    ns["d"]["n"] = 2  # in-place mutation of a dict is seen
    report = cp.save(ns)
    assert sorted(report.written) == ["b", "d"] and report.unchanged == ["a"]
    del ns["a"]
    assert cp.save(ns).removed == ["a"]
    assert len(list(store.blobs.iterdir())) == 2  # the old blobs were collected


def test_large_change_waits_for_an_exact_save(store):
    cp = NamespaceCheckpointer(store, incremental_max_bytes=1_000_000)
    ns = {"big": np.zeros(1_000_000)}
    report = cp.save(ns)
    assert not report.committed and "per-cell limit" in report.skipped
    assert cp.save(ns, exact=True).written == ["big"]


def test_exact_save_catches_a_sparse_edit_the_sampled_check_misses(store):
    cp = NamespaceCheckpointer(store)
    ns = {"a": np.zeros(4_000_000)}
    cp.save(ns, exact=True)
    ns["a"][12345] = 1.0  # one element of a 32 MB array: not among the sampled blocks
    assert cp.save(ns).skipped == "nothing changed"
    assert cp.save(ns, exact=True).written == ["a"]
    fresh: dict = {}
    NamespaceCheckpointer(store).restore(fresh)
    assert fresh["a"][12345] == 1.0


def test_describe_offers_count_size_and_time(store, tmp_path):
    NamespaceCheckpointer(store).save({"a": np.zeros(150_000), "b": 1, "np": np}, exact=True)
    text = describe(store.path, key_for("alice"), "alice")
    assert text is not None and text.startswith("Restore 3 variables (1.2 MB, saved ")
    assert describe(store.path, key_for("bob"), "bob") is None
    assert set(list_checkpoints(store.path.parent, key_for("alice"), "alice")) == {"default"}
    assert list_checkpoints(store.path.parent, key_for("bob"), "bob") == {}


# -- signatures --------------------------------------------------------------------------------


def test_user_keys_are_deterministic_and_distinct():
    assert derive_user_key(HUB_SECRET, "alice") == derive_user_key(HUB_SECRET, "alice")
    assert derive_user_key(HUB_SECRET, "alice") != derive_user_key(HUB_SECRET, "bob")
    assert derive_user_key(HUB_SECRET, "alice") != derive_user_key(HUB_SECRET[::-1], "alice")
    with pytest.raises(ValueError, match="at least 16"):
        derive_user_key(b"short", "alice")


def test_another_users_key_cannot_restore(store):
    NamespaceCheckpointer(store).save({"secret": [1, 2, 3]}, exact=True)
    as_bob = CheckpointStore(store.path, key_for("bob"), "bob")
    with pytest.raises(CheckpointRefused, match="signature does not match"):
        NamespaceCheckpointer(as_bob).restore({})


def test_manifest_signed_for_another_user_name_is_refused(store):
    # even with alice's key, a manifest that names another user is not loaded as alice's
    other = CheckpointStore(store.path, key_for("alice"), "mallory")
    NamespaceCheckpointer(other).save({"x": 1}, exact=True)
    with pytest.raises(CheckpointRefused, match="written for user 'mallory'"):
        store.read_manifest()


def test_tampered_blob_is_refused_before_anything_is_unpickled(store, tmp_path):
    NamespaceCheckpointer(store).save({"a": np.arange(10), "b": [1]}, exact=True)
    entry = store.read_manifest().variables["b"]
    path = store.blobs / entry.blob
    data = bytearray(path.read_bytes())
    data[-70] ^= 0xFF
    path.write_bytes(bytes(data))
    ns: dict = {}
    with pytest.raises(CheckpointRefused, match="signature does not match"):
        NamespaceCheckpointer(store).restore(ns)
    assert ns == {}  # all or nothing: 'a' was fine but is not loaded either


def test_foreign_pickle_is_never_loaded(store, tmp_path):
    NamespaceCheckpointer(store).save({"x": 1}, exact=True)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    entry = store.read_manifest().variables["x"]
    (store.blobs / entry.blob).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointRefused):
        NamespaceCheckpointer(store).restore({})
    # an unsigned manifest pointing at it is refused too
    manifest = json.loads((store.path / CURRENT).read_bytes().partition(b"\n")[2])
    manifest["variables"]["x"]["size"] = (store.blobs / entry.blob).stat().st_size
    (store.path / CURRENT).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointRefused, match="not signed"):
        NamespaceCheckpointer(store).restore({})
    assert not marker.exists()


def test_checkpoint_files_are_private(store):
    NamespaceCheckpointer(store).save({"a": np.arange(10)}, exact=True)
    for d in (store.path.parent, store.path, store.blobs):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in [store.path / CURRENT, *store.blobs.iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another system user")
def test_another_system_user_cannot_list_or_read_checkpoints():
    base = Path(tempfile.mkdtemp(prefix="gpulab-perm-"))
    try:
        os.chmod(base, 0o755)  # traversable by anyone: only the store's own modes protect it
        control = base / "public.txt"
        control.write_text("anyone may read this")
        store = CheckpointStore(base / "ckpt" / "default", key_for("alice"), "alice")
        NamespaceCheckpointer(store).save({"a": np.arange(10)}, exact=True)
        blob = next(store.blobs.iterdir())
        targets = [control, store.path.parent, store.path, store.path / CURRENT, blob]
        probe = (
            'for p in "$@"; do if [ -d "$p" ]; then ls "$p" >/dev/null 2>&1 && echo "READ $p" || echo "DENIED $p"; '
            'else cat "$p" >/dev/null 2>&1 && echo "READ $p" || echo "DENIED $p"; fi; done'
        )
        out = subprocess.run(
            ["/bin/sh", "-c", probe, "probe", *map(str, targets)],
            user=65534,
            group=65534,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        assert out[0] == f"READ {control}", out  # the probe can read what is public
        assert all(line.startswith("DENIED") for line in out[1:]), out
    finally:
        shutil.rmtree(base)


def test_restore_from_another_users_store_path_is_refused_even_with_read_access(tmp_path):
    alice = CheckpointStore(tmp_path / "a" / "default", key_for("alice"), "alice")
    NamespaceCheckpointer(alice).save({"x": 1}, exact=True)
    bob_view = CheckpointStore(Path(alice.path), key_for("bob"), "bob")
    with pytest.raises(CheckpointRefused):
        bob_view.read_manifest()
    assert describe(alice.path, key_for("bob"), "bob") is None


def test_after_preemption_the_killed_kernels_state_wins_over_an_older_offer(store):
    NamespaceCheckpointer(store).save({"x": "last session"}, exact=True)
    store.offer_previous()  # a kernel started and moved it aside, never restored it ...
    NamespaceCheckpointer(store).save({"x": "killed kernel"}, exact=True)  # ... and was preempted
    manual, auto = {}, {}
    NamespaceCheckpointer(store).restore(auto, prefer_current=True)
    assert auto["x"] == "killed kernel"
    NamespaceCheckpointer(store).restore(manual)
    assert manual["x"] == "last session"


def test_each_notebook_gets_its_own_slot():
    from gpulab.spawner.singleuser.checkpoint.kernel import slot_name

    a = slot_name({"JPY_SESSION_NAME": "/home/alice/exp/train.ipynb"})
    b = slot_name({"JPY_SESSION_NAME": "/home/alice/other/train.ipynb"})
    assert a.startswith("train.ipynb-") and b.startswith("train.ipynb-") and a != b
    assert slot_name({}) == "default"
    assert slot_name({"GPULAB_CHECKPOINT_SLOT": "../../etc"}) == ".._.._etc"


def test_a_manifest_replaced_by_a_fifo_a_link_or_a_huge_file_is_refused_without_waiting(store):
    # what a user can put where a manifest should be: none of it may block the reader (the hub's
    # worker, a kernel) or fill its memory
    store.path.mkdir(parents=True, exist_ok=True)
    manifest = store.path / CURRENT
    os.mkfifo(manifest)
    with pytest.raises(CheckpointRefused, match="not a regular file"):
        store.read_manifest()
    manifest.unlink()
    manifest.symlink_to("/dev/zero")
    with pytest.raises(CheckpointRefused, match="symbolic link"):
        store.read_manifest()
    manifest.unlink()
    with open(manifest, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(CheckpointRefused, match="regular file of at most"):
        store.read_manifest()
