"""The singleuser image's GPU smoke test (gpulab.spawner.singleuser.gpu_smoke_test) without a GPU:
it says it skipped and why, fails where NVML shows a GPU that PyTorch cannot use, and its NVML
check over the labelled FAKE pynvml (tests/harness/fake_nvml). On a GPU it runs for real in the
image (see images/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpulab.spawner import environment as local_enforcement
from gpulab.spawner.kube.gpu_resources import SHARING_BACKENDS
from gpulab.spawner.singleuser.gpu_smoke_test import (
    ENFORCED_BY,
    FAILED,
    NOT_ENFORCED,
    SKIPPED,
    nvml_devices,
    nvml_sees_process,
    share_spec,
)
from tests.harness import fake_nvml
from tests.harness.fake_nvml import a100, mig_instance

MODULE = "gpulab.spawner.singleuser.gpu_smoke_test"
HAS_DRIVER = Path("/dev/nvidiactl").exists()


def run_smoke_test(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # the server's environment without any gpulab share, plus what the test adds
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAB_")}
    env.pop("NVIDIA_VISIBLE_DEVICES", None)
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", MODULE], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver: the test runs for real")
def test_without_a_gpu_it_exits_skipped_and_says_why():
    result = run_smoke_test({})
    assert result.returncode == SKIPPED, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-smoke-test: skipped: no GPU: ")
    # the reason names what was looked at: PyTorch's CUDA and NVML
    assert "PyTorch" in last or "torch" in last
    assert "NVML" in last


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver: the test runs for real")
def test_a_gpu_that_nvml_shows_but_pytorch_cannot_use_fails(tmp_path):
    machine = {"gpus": [a100(0)]}
    result = run_smoke_test(fake_nvml.subprocess_env(machine, tmp_path / "machine.json"))
    assert result.returncode == FAILED, result.stdout + result.stderr
    assert "gpu-smoke-test: torch: failed: NVML shows 1 device(s) but " in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "gpu-smoke-test: failed: 1 of 1 checks"


def nvml_check(machine: dict[str, Any], pid: int, uuids: tuple[str, ...] = ()) -> tuple[str, str]:
    share = share_spec({"GPULAB_GPU_UUIDS": ",".join(uuids)})
    with fake_nvml.installed(machine) as nvml:
        nvml.nvmlInit()
        try:
            return nvml_sees_process(
                nvml, nvml_devices(nvml), share, pid, 256 * 1024 * 1024, lambda p: p == pid
            )
        finally:
            nvml.nvmlShutdown()


def test_nvml_finds_the_process_on_its_shares_device():
    gpu = a100(0, processes=[{"pid": 4242, "memory_mib": 300}])
    outcome, detail = nvml_check({"gpus": [a100(1), gpu]}, 4242, (gpu["uuid"],))
    assert outcome == "passed" and gpu["uuid"] in detail


def test_nvml_finds_the_process_on_its_mig_instance():
    inst = mig_instance(0, 0, "2g.20gb", 19968, processes=[{"pid": 4242, "memory_mib": 300}])
    machine = {"gpus": [a100(0, mig={"max": 7, "instances": [inst]})]}
    outcome, detail = nvml_check(machine, 4242, (inst["uuid"],))
    assert outcome == "passed" and inst["uuid"] in detail


def test_the_process_on_a_device_outside_its_share_fails():
    other = a100(1, processes=[{"pid": 4242, "memory_mib": 300}])
    outcome, detail = nvml_check({"gpus": [a100(0), other]}, 4242, (a100(0)["uuid"],))
    assert outcome == "failed" and "not one of the share's devices" in detail


def test_in_a_container_a_host_pid_holding_the_memory_counts():
    # NVML reports host PIDs; 99999 is not visible in this PID namespace
    gpu = a100(0, processes=[{"pid": 99999, "memory_mib": 300}])
    outcome, detail = nvml_check({"gpus": [gpu]}, 4242)
    assert outcome == "passed" and "host pid" in detail


def test_a_process_nvml_does_not_list_fails():
    gpu = a100(0, processes=[{"pid": 99999, "memory_mib": 10}])  # too little to be ours
    outcome, _ = nvml_check({"gpus": [gpu]}, 4242)
    assert outcome == "failed"


def test_every_enforcement_a_spawner_states_has_a_limit_rule():
    stated = {
        local_enforcement.EXCLUSIVE,
        local_enforcement.MIG,
        local_enforcement.MPS,
        local_enforcement.FRAMEWORK_CAPS,
        *SHARING_BACKENDS,
    }
    # whole GPUs have no limit below the device; the rest are enforced or say they are not
    assert stated - {local_enforcement.EXCLUSIVE} <= set(ENFORCED_BY) | set(NOT_ENFORCED)
