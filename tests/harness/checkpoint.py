"""Checkpoint test helpers: the hub secret and users' keys as the hub derives them, and a real
IPython kernel (jupyter_client) with gpulab's checkpoint extension loaded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from jupyter_client import KernelManager

from gpulab.spawner.singleuser.checkpoint import derive_user_key

HUB_SECRET = b"test-hub-secret-" * 2


def key_for(user: str) -> bytes:
    return derive_user_key(HUB_SECRET, user)


def key_file_for(directory: Path, user: str) -> Path:
    """A key file for `user` as the hub writes one (hex, owner-only), for GPULAB_CHECKPOINT_KEY_FILE."""
    path = directory / f"key-{user}"
    path.write_text(key_for(user).hex())
    path.chmod(0o400)
    return path


class Kernel:
    """A real ipykernel with the checkpoint extension loaded, driven over ZMQ."""

    def __init__(self, env: dict[str, str]) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.shutdown_wait_time = (
            30  # what server_args() gives a server: time for the final save
        )
        self.km.start_kernel(
            env=env, extra_arguments=["--ext=gpulab.spawner.singleuser.checkpoint.kernel"]
        )
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.km.is_alive():
                break
            time.sleep(0.1)
        self.kc.stop_channels()
        return self.km.provisioner.process.poll() if self.km.provisioner else None  # type: ignore[union-attr]
