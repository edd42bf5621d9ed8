"""Fixtures for checkpoint tests: stores, kernel environments and real IPython kernels (the
helpers behind them are in tests/harness/checkpoint.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpulab.spawner.singleuser.checkpoint.store import CheckpointStore
from tests.harness.checkpoint import Kernel, key_file_for, key_for


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt" / "default", key_for("alice"), "alice")


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
