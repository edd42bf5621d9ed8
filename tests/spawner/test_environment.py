"""Placement -> process environment, and the framework caps hook that applies it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gpulab.spawner.environment import (
    CAPS_HOOK_DIR,
    AssignedGPU,
    gpu_environment,
    with_caps_hook,
)

A100 = 81920


def test_whole_gpus_are_listed_by_uuid_and_exclusive():
    env, enf = gpu_environment(
        [AssignedGPU("GPU-a", "A100", A100, 1000), AssignedGPU("GPU-b", "A100", A100, 1000)]
    )
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert enf.mechanism == "exclusive" and "these 2 GPUs are yours alone" in enf.isolation
    assert "GPULAB_GPU_MEMORY_LIMIT_MIB" not in env


def test_cpu_only_hides_every_gpu():
    env, enf = gpu_environment([])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert enf.mechanism == "cpu-only"


def test_fraction_without_mps_gets_framework_caps():
    env, enf = gpu_environment([AssignedGPU("GPU-a", "A100", A100, 125)])
    assert enf.mechanism == "framework-caps"
    assert env["GPULAB_GPU_MEMORY_LIMIT_MIB"] == "10240"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.125"
    assert "expandable_segments:True" in env["PYTORCH_CUDA_ALLOC_CONF"]
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert env["GPULAB_CAPS_HOOK"] == "1"
    assert "cooperative" in enf.isolation and "10240 MiB" in enf.isolation
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_fraction_with_mps_gets_driver_limits():
    env, enf = gpu_environment(
        [AssignedGPU("GPU-a", "A100", A100, 125)], mps_pipe_directory="/run/mps"
    )
    assert enf.mechanism == "mps"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "13"  # rounded up, never 0 %
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    assert "GPULAB_CAPS_HOOK" not in env
    assert "CUDA MPS" in enf.isolation


def test_caps_hook_caps_torch_and_tensorflow_when_they_are_imported(tmp_path):
    # Stand-ins for torch/tensorflow (not installed here) that record what the hook asks of them;
    # the hook code under test is gpulab's real sitecustomize.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        textwrap.dedent("""
        calls = []
        class cuda:
            @staticmethod
            def is_available(): return True
            @staticmethod
            def device_count(): return 1
            @staticmethod
            def set_per_process_memory_fraction(fraction, device): calls.append((fraction, device))
    """)
    )
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(
        textwrap.dedent("""
        calls = []
        class config:
            class LogicalDeviceConfiguration:
                def __init__(self, memory_limit): self.memory_limit = memory_limit
            @staticmethod
            def list_physical_devices(kind): return ["GPU:0"]
            @staticmethod
            def set_logical_device_configuration(gpu, confs): calls.append((gpu, confs[0].memory_limit))
    """)
    )
    env = dict(os.environ)
    gpu_env, _ = gpu_environment([AssignedGPU("GPU-a", "A100", A100, 250)])
    env.update(gpu_env)
    env["PYTHONPATH"] = with_caps_hook(str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", "import torch, tensorflow; print(torch.calls, tensorflow.calls)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "[(0.25, 0)] [('GPU:0', 20480)]"


def test_caps_hook_does_nothing_without_a_fractional_share(tmp_path):
    (tmp_path / "torch.py").write_text("loaded = True\n")
    env = dict(os.environ, PYTHONPATH=with_caps_hook(str(tmp_path)))
    env.pop("GPULAB_CAPS_HOOK", None)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch; print(any('CapAfterImport' in type(f).__name__ for f in sys.meta_path))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False"
    assert CAPS_HOOK_DIR.endswith("gpu_caps")


def test_a_mig_instance_is_handed_out_by_its_uuid_and_enforced_by_the_hardware():
    instance = AssignedGPU("MIG-4b1e3c2a-0000", "A100-SXM4-80GB", 20480, 250, "2g.20gb")
    env, enf = gpu_environment([instance])
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-4b1e3c2a-0000"  # never the parent GPU
    assert enf.mechanism == "mig" and "hardware holds you to 20480 MiB" in enf.isolation
    assert env["GPULAB_GPU_MEMORY_LIMIT_MIB"] == "20480" and env["GPULAB_GPU_FRACTION"] == "0.250"
    assert env["GPULAB_GPU_MODEL"] == "A100-SXM4-80GB MIG 2g.20gb"
    assert "GPULAB_CAPS_HOOK" not in env and "CUDA_MPS_PIPE_DIRECTORY" not in env
    # MPS on the machine changes nothing for a MIG instance
    _, with_mps = gpu_environment([instance], mps_pipe_directory="/run/mps")
    assert with_mps.mechanism == "mig"


@pytest.mark.parametrize(
    ("gpus", "visible"),
    [
        pytest.param(
            [AssignedGPU("GPU-a", "A100", A100, 1000), AssignedGPU("GPU-b", "A100", A100, 1000)],
            "GPU-a,GPU-b",
            id="whole",
        ),
        pytest.param([AssignedGPU("GPU-a", "A100", A100, 250)], "GPU-a", id="fractional"),
        pytest.param(
            [AssignedGPU("MIG-a", "A100", 20480, 250, mig_profile="2g.20gb")], "MIG-a", id="mig"
        ),
        pytest.param([], "void", id="cpu"),
    ],
)
def test_the_placement_names_exactly_the_visible_devices_over_an_inherited_all(gpus, visible):
    # GPULocalSpawner.get_env lays the placement's variables over the configured environment
    # (which may carry the hub's own NVIDIA_VISIBLE_DEVICES=all): the placement always sets it
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    env.update(gpu_environment(gpus)[0])
    assert env["NVIDIA_VISIBLE_DEVICES"] == visible
