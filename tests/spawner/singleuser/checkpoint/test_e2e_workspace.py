"""End to end on the local backend: a real hub spawns servers whose environment comes from
`persistent_env` and whose kernels load the checkpoint extension; kernel variables and installed
packages survive stopping and starting the server."""

from __future__ import annotations

from pathlib import Path

import pytest
from traitlets.config import Config

from tests.harness.hub import Hub, run_in_kernel
from tests.harness.wheels import build_tiny_wheel

# Nothing to configure: GPUSimpleLocalSpawner wires the workspace in by default (environment from
# persistent_env with the user's derived key, the home prepared before spawn, a shutdown grace for
# the final save, a snapshot of the home on stop).
OVERLAY = Config()


@pytest.fixture(scope="module")
def hub(make_module_hub) -> Hub:
    h = make_module_hub(OVERLAY, name="ckpt-e2e")
    h.create_user("alice")
    return h


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


async def test_packages_installed_in_a_kernel_survive_a_server_restart(hub):
    # the wheel must be readable by alice's account: next to the hub's state, not in pytest's
    # private tmp_path
    wheels = hub.state_dir / "wheels"
    wheels.mkdir(mode=0o755, exist_ok=True)
    wheels.chmod(0o755)
    wheel = build_tiny_wheel(wheels)
    hub.start_server("alice")
    out = await run_in_kernel(
        hub, "alice", f"%pip install --no-index --no-deps {wheel}", timeout=120
    )
    assert "Successfully installed gpulab-tinypkg-1.0" in out, out
    _restart(hub, "alice")
    out = await run_in_kernel(
        hub, "alice", "import gpulab_tinypkg as t\nprint(t.VALUE, t.__file__)"
    )
    home = hub.home("alice")
    assert out.strip().splitlines()[-1].startswith(f"42 {home}/.local/")
    hub.stop_server("alice")
    # every stop left a snapshot of the home, with the package in it
    store = Path(hub.state_dir) / "snapshots" / "alice" / "default"
    snapshots = sorted(p.name for p in store.iterdir() if not p.name.startswith("."))
    assert snapshots, f"no snapshot in {store}"
