"""End to end on the local backend: a real hub spawns servers whose environment comes from
`persistent_env` and whose kernels load the checkpoint extension; kernel variables and installed
packages survive stopping and starting the server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoint.wheels import build_tiny_wheel
from tests.hubtools import Hub, run_in_kernel

pytestmark = pytest.mark.e2e

# What the spawner owner wires in: environment from persistent_env (per user and server, with the
# user's key), the home prepared before spawn, and a shutdown grace for the final save.
OVERLAY = """
import os
from pathlib import Path
from gpulab.spawner.checkpoint import derive_user_key
from gpulab.spawner.checkpoint.environment import persistent_env, prepare_home, server_args

_SECRET = b"e2e-hub-secret-0123456789abcdef"

def _env_of(spawner):
    return persistent_env(
        Path(spawner.home_dir),
        server=spawner.name,
        base_env=os.environ,
        key=derive_user_key(_SECRET, spawner.user.name),
        user=spawner.user.name,
    )

def _value(name):
    return lambda spawner: _env_of(spawner)[name]

_names = persistent_env(Path("/h"), key=b"k" * 32, user="u")
c.GPUSimpleLocalSpawner.environment = {name: _value(name) for name in _names}
c.Spawner.pre_spawn_hook = lambda spawner: prepare_home(Path(spawner.home_dir))
c.GPUSimpleLocalSpawner.args = server_args(20)
c.GPUSimpleLocalSpawner.interrupt_timeout = 45
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    h = Hub(tmp_path_factory.mktemp("ckpt-e2e") / "hub", OVERLAY)
    h.start()
    try:
        h.create_user("alice")
        yield h
    finally:
        h.close()


def _restart(hub: Hub, user: str) -> None:
    hub.stop_server(user)
    hub.start_server(user)


async def test_kernel_variables_survive_a_server_restart(hub):
    hub.start_server("alice")
    setup = (
        "import numpy as np\n"
        "w = np.arange(12.0).reshape(3, 4)\n"
        "cfg = {'lr': 0.1, 'tags': ['a', 'b']}\n"
        "def loss(x):\n    return float((w * x).sum()) * cfg['lr']\n"
        "print(w.sum(), cfg, loss(2))"
    )
    before = await run_in_kernel(hub, "alice", setup)  # the kernel is shut down afterwards
    _restart(hub, "alice")
    out = await run_in_kernel(hub, "alice", "%gpulab_restore\nprint(w.sum(), cfg, loss(2))")
    lines = out.strip().splitlines()
    assert (
        lines[0].startswith("gpulab: Restore 4 variables (") and "run %gpulab_restore" in lines[0]
    )
    assert lines[1].startswith("restored 4 variables: cfg, loss, np, w")
    assert lines[-1] == before.strip()
    hub.stop_server("alice")


async def test_packages_installed_in_a_kernel_survive_a_server_restart(hub, tmp_path):
    wheel = build_tiny_wheel(tmp_path)
    hub.start_server("alice")
    out = await run_in_kernel(
        hub, "alice", f"%pip install --no-index --no-deps {wheel}", timeout=120
    )
    assert "Successfully installed gpulab-tinypkg-1.0" in out, out
    _restart(hub, "alice")
    out = await run_in_kernel(
        hub, "alice", "import gpulab_tinypkg as t\nprint(t.VALUE, t.__file__)"
    )
    home = Path(hub.state_dir) / "homes" / "alice"
    assert out.strip().splitlines()[-1].startswith(f"42 {home}/.local/")
    hub.stop_server("alice")
