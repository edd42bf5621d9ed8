"""The IPython extension in real kernels (jupyter_client): save after cells, at shutdown and on
SIGTERM; offer and restore on the next start; automatic restore; refusal of others' checkpoints."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from gpulab.spawner.singleuser.checkpoint.namespace import unpickle_value
from gpulab.spawner.singleuser.checkpoint.store import CURRENT, OFFERED, CheckpointStore
from tests.harness.wait import wait_for

SETUP = """
import numpy as np
weights = np.arange(200_000, dtype=np.float32).reshape(400, 500)
view = weights
config = {"lr": 0.01, "layers": [64, 32]}
def scale(x, by=2):
    return x * by * config["lr"]
class Run:
    def __init__(self, name):
        self.name = name
    def label(self):
        return self.name.upper()
run = Run("baseline")
gen = (i for i in range(3))
"""

CHECK = """
print(weights.shape, weights.dtype, float(weights.sum()), view is weights)
print(config, scale(10), run.label(), np.__name__)
"""


def _manifest(root: Path, which: str = CURRENT) -> dict:
    raw = (root / "default" / which).read_bytes().partition(b"\n")[2]
    return json.loads(raw)


def test_variables_come_back_after_a_restart_when_the_user_restores(
    kernel_env, start_kernel, tmp_path
):
    env = kernel_env()
    k1 = start_kernel(env)
    k1.run(SETUP)
    expected = k1.run(CHECK)
    k1.shutdown()

    k2 = start_kernel(env)
    first = k2.run("print('weights' in globals())")
    assert "Restore 7 variables (" in first and "run %gpulab_restore" in first
    assert first.strip().endswith("False")
    assert (tmp_path / "ckpt" / "default" / OFFERED).exists()
    out = k2.run("%gpulab_restore")
    assert "restored 7 variables" in out
    assert "not in the checkpoint (unpicklable): gen" in out
    assert k2.run(CHECK) == expected
    assert not (tmp_path / "ckpt" / "default" / OFFERED).exists()  # adopted as the current one


def test_a_cell_is_saved_once_the_kernel_is_idle_and_survives_a_kill(
    kernel_env, start_kernel, tmp_path
):
    env = kernel_env()
    root = tmp_path / "ckpt"
    k1 = start_kernel(env)
    k1.run("x = [1, 2, 3]")
    wait_for(
        "a checkpoint with x",
        lambda: (root / "default" / CURRENT).exists() and "x" in _manifest(root)["variables"],
        20,
        0.1,
    )
    assert _manifest(root)["kind"] == "incremental"
    k1.run("x.append(4)")
    wait_for("x saved as [1, 2, 3, 4]", lambda: _saved_x(root, env) == [1, 2, 3, 4], 20, 0.1)
    os.kill(k1.pid, signal.SIGKILL)  # no chance to save at exit
    k1.wait_exit()

    k2 = start_kernel(env)
    k2.run("%gpulab_restore")
    assert k2.run("print(x)").strip() == "[1, 2, 3, 4]"


def _saved_x(root: Path, env: dict[str, str]) -> object:
    """What the current checkpoint holds for `x`, read the way a restore does (verified)."""
    store = CheckpointStore(
        root / "default",
        bytes.fromhex(Path(env["GPULAB_CHECKPOINT_KEY_FILE"]).read_text()),
        "alice",
    )
    header, segments = store.verified_blobs(store.read_manifest())["x"]
    return unpickle_value(header, segments)


def test_sigterm_saves_the_final_state_then_the_kernel_exits(kernel_env, start_kernel):
    # per-cell saves off (limit 0 bytes): only the SIGTERM handler can have saved `late`
    env = kernel_env(GPULAB_CHECKPOINT_INCREMENTAL_MB="0")
    k1 = start_kernel(env)
    k1.run("late = {'epoch': 7}")
    os.kill(k1.pid, signal.SIGTERM)
    assert k1.wait_exit() == -signal.SIGTERM  # the default action still happens after the save

    k2 = start_kernel(env)
    k2.run("%gpulab_restore")
    assert k2.run("print(late)").strip() == "{'epoch': 7}"


def test_automatic_restore_after_preemption_needs_no_user_action(
    kernel_env, start_kernel, tmp_path
):
    env = kernel_env()
    k1 = start_kernel(env)
    k1.run(SETUP)
    expected = k1.run(CHECK)
    os.kill(k1.pid, signal.SIGTERM)  # preemption
    k1.wait_exit()

    k2 = start_kernel(kernel_env(GPULAB_AUTO_RESTORE="1"))
    out = k2.run(CHECK)
    assert "automatic restore" in out and out.endswith(expected)
    # restored variables are the user's again: listed by %who and saved when they change
    assert "weights" in k2.run("%who")
    k2.run("config['lr'] = 0.5")
    k2.shutdown()
    k3 = start_kernel(kernel_env(GPULAB_AUTO_RESTORE="1"))
    assert "0.5" in k3.run("print(config['lr'])")


def test_another_users_kernel_cannot_restore_or_overwrite_a_checkpoint(
    kernel_env, start_kernel, tmp_path
):
    k1 = start_kernel(kernel_env("alice"))
    k1.run("secret = 'alice only'")
    k1.shutdown()
    before = (tmp_path / "ckpt" / "default" / CURRENT).read_bytes()

    k2 = start_kernel(kernel_env("bob"))
    first = k2.run("mine = 1")
    assert "checkpoints are off in this kernel" in first and "signature does not match" in first
    out = k2.run("%gpulab_restore\nprint('secret' in globals())")
    assert "checkpoint refused" in out and "False" in out.splitlines()
    k2.shutdown()
    assert (tmp_path / "ckpt" / "default" / CURRENT).read_bytes() == before  # untouched


def test_save_on_demand_lists_unpicklable_objects(kernel_env, start_kernel):
    k = start_kernel(kernel_env())
    k.run("import threading, sqlite3\nconn = sqlite3.connect(':memory:')\nok = 1")
    out = k.run("%gpulab_save")
    assert "checkpoint saved (full)" in out and "not saved: conn (" in out
    assert "nothing changed" in k.run("%gpulab_save")
