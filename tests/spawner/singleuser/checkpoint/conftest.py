"""Fixtures for checkpoint tests: keys, stores, and real IPython kernels (jupyter_client)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import KernelManager

from gpulab.spawner.singleuser.checkpoint import derive_user_key
from gpulab.spawner.singleuser.checkpoint.store import CheckpointStore

HUB_SECRET = b"test-hub-secret-" * 2


def key_for(user: str) -> bytes:
    return derive_user_key(HUB_SECRET, user)


def key_file_for(directory: Path, user: str) -> Path:
    """A key file for `user` as the hub writes one (hex, owner-only), for GPULAB_CHECKPOINT_KEY_FILE."""
    path = directory / f"key-{user}"
    path.write_text(key_for(user).hex())
    path.chmod(0o400)
    return path


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt" / "default", key_for("alice"), "alice")


class Kernel:
    """A real ipykernel with the checkpoint extension loaded, driven over ZMQ."""

    def __init__(self, env: dict[str, str]) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.shutdown_wait_time = (
            30  # what server_args() gives a server: time for the final save
        )
        self.km.start_kernel(env=env, extra_arguments=["--ext=gpulab.spawner.singleuser.checkpoint.kernel"])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.pid)  # type: ignore[union-attr]

    def run(self, code: str, timeout: float = 60) -> str:
        out: list[str] = []
        errors: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                errors.append("\n".join(msg["content"]["traceback"]))

        self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        if errors:
            raise AssertionError("kernel error:\n" + "\n".join(errors))
        return "".join(out)

    def shutdown(self) -> None:
        """Graceful, as jupyter_server does it: shutdown_request, then wait for the exit."""
        if self.km.is_alive():
            self.km.shutdown_kernel(now=False)
        self.kc.stop_channels()

    def wait_exit(self, timeout: float = 30) -> int | None:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.km.is_alive():
                break
            time.sleep(0.1)
        self.kc.stop_channels()
        return self.km.provisioner.process.poll() if self.km.provisioner else None  # type: ignore[union-attr]


@pytest.fixture
def kernel_env(tmp_path: Path) -> Callable[..., dict[str, str]]:
    def make(user: str = "alice", **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GPULAB_", "JPY_", "JUPYTERHUB_"))
        }
        env.update(
            GPULAB_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
            GPULAB_CHECKPOINT_KEY_FILE=str(key_file_for(tmp_path, user)),
            GPULAB_CHECKPOINT_USER=user,
            IPYTHONDIR=str(tmp_path / "ipython"),
        )
        env.update(extra)
        return env

    return make


@pytest.fixture
def start_kernel() -> Iterator[Callable[[dict[str, str]], Kernel]]:
    kernels: list[Kernel] = []

    def start(env: dict[str, str]) -> Kernel:
        k = Kernel(env)
        kernels.append(k)
        return k

    yield start
    for k in kernels:
        try:
            if k.km.is_alive():
                k.km.shutdown_kernel(now=True)
            k.kc.stop_channels()
        except Exception:
            pass
