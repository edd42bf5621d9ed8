"""GPU smoke test of a user server: the GPU works and the server's share holds.

Shipped in the singleuser image (gpulab's wheel; `gpulab-gpu-smoke-test` on PATH) and runnable
from a checkout (`python -m gpulab.spawner.singleuser.gpu_smoke_test`). Run it in a server's
terminal, or as a pod's command with the server's environment; it reads the share from the
variables gpulab's spawners set (gpulab.spawner.names) and checks

1. PyTorch: `torch.cuda.is_available()`, and it sees as many devices as the share names;
2. a matmul on the GPU equals the CPU's;
3. NVML lists this process on one of the share's devices (by PID, or, where NVML reports host PIDs
   of a container's processes, by its memory);
4. the share's memory limit holds where the sharing backend enforces one (MIG, HAMi, CUDA MPS,
   gpulab's framework caps): an allocation within it succeeds and one beyond it fails. Whole
   GPUs have no limit below the device; time-slicing enforces none (that check says so, skipped).

A server whose share is CPU-only must see no GPU at all (an image's NVIDIA_VISIBLE_DEVICES=all
must not have widened it). Without a GPU the test is skipped, never passed: exit status 77 (the
"skipped" status of automake and meson) and a line saying why. Exit 0: every check that could run
passed (skipped ones are listed with their reason); exit 1: a check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from gpulab.spawner.names import (
    GPU_ENFORCEMENT_ENV,
    GPU_INVENTORY_ENV,
    GPU_MEMORY_LIMIT_MIB_ENV,
    GPU_UUIDS_ENV,
)

PASSED, FAILED, SKIPPED = 0, 1, 77
PREFIX = "gpu-smoke-test"
MIB = 1024 * 1024
#: GPU_ENFORCEMENT_ENV values (gpulab.spawner.environment and the kube sharing backends) whose
#: memory limit something enforces, and what
ENFORCED_BY = {
    "mig": "the MIG instance's hardware",
    "hami": "HAMi's CUDA interposer",
    "mps": "the CUDA MPS server",
    "framework-caps": "gpulab's framework caps (PyTorch's per-process memory fraction)",
}
NOT_ENFORCED = {
    "time-slicing": "time-slicing enforces no memory limit: the stated one is the replica's "
    "part of the GPU, which nothing holds a process to",
}


@dataclass(frozen=True)
class ShareSpec:
    """What the spawner told this process about its share."""

    uuids: tuple[str, ...]  # the devices, where named (empty: unknown, or none)
    enforcement: str  # "" when no gpulab spawner started this process
    memory_limit_mib: int | None
    inventory: str  # "declared" / "simulated": the hub's GPUs are not real here

    @property
    def cpu_only(self) -> bool:
        return self.enforcement == "cpu-only"


def share_spec(env: Mapping[str, str]) -> ShareSpec:
    # the local spawner names the devices in GPU_UUIDS_ENV; on Kubernetes the device plugin names
    # them in NVIDIA_VISIBLE_DEVICES ("all", "void", "none" name no device in particular)
    listed = env.get(GPU_UUIDS_ENV, "") or env.get("NVIDIA_VISIBLE_DEVICES", "")
    if listed.strip().lower() in ("all", "void", "none"):
        listed = ""
    raw_limit = env.get(GPU_MEMORY_LIMIT_MIB_ENV, "").strip()
    return ShareSpec(
        uuids=tuple(u.strip() for u in listed.split(",") if u.strip()),
        enforcement=env.get(GPU_ENFORCEMENT_ENV, "").strip(),
        memory_limit_mib=int(float(raw_limit)) if raw_limit else None,
        inventory=env.get(GPU_INVENTORY_ENV, "").strip(),
    )


@dataclass
class Report:
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # check, outcome, detail

    def add(self, check: str, outcome: str, detail: str) -> None:
        self.lines.append((check, outcome, detail))

    def outcomes(self) -> list[str]:
        return [outcome for _, outcome, _ in self.lines]


@dataclass(frozen=True)
class NvmlDevice:
    uuid: str
    handle: Any


def nvml_devices(nvml: ModuleType) -> list[NvmlDevice]:
    """Every device NVML shows this process, MIG instances included (after nvmlInit)."""
    devices = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        devices.append(NvmlDevice(str(nvml.nvmlDeviceGetUUID(handle)), handle))
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            continue  # not MIG-capable
        if not current:
            continue
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError:
                continue  # an empty slot
            devices.append(NvmlDevice(str(nvml.nvmlDeviceGetUUID(mig)), mig))
    return devices


def nvml_sees_process(
    nvml: ModuleType,
    devices: Sequence[NvmlDevice],
    share: ShareSpec,
    pid: int,
    min_memory_bytes: int,
    pid_visible: Callable[[int], bool],
) -> tuple[str, str]:
    """(outcome, detail) of check 3: NVML lists `pid` on one of the share's devices. In a
    container NVML reports host PIDs, which are not this process's; then a process that is not
    visible here (`pid_visible`) holding at least `min_memory_bytes` on the device counts."""
    listed_anywhere = False
    by_memory: list[str] = []
    unsupported: list[str] = []
    for device in devices:
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(device.handle)
        except nvml.NVMLError as e:
            unsupported.append(f"{device.uuid}: {e}")
            continue
        for process in processes:
            listed_anywhere = True
            if process.pid == pid:
                if share.uuids and device.uuid not in share.uuids:
                    return "failed", (
                        f"NVML lists this process (pid {pid}) on {device.uuid}, which is not "
                        f"one of the share's devices {list(share.uuids)}"
                    )
                return "passed", f"NVML lists this process (pid {pid}) on {device.uuid}"
            used = process.usedGpuMemory or 0
            if not pid_visible(process.pid) and used >= min_memory_bytes:
                by_memory.append(device.uuid)
    if by_memory:
        return "passed", (
            f"NVML lists a process of this container (host pid, {min_memory_bytes // MIB}+ MiB) "
            f"on {by_memory[0]}"
        )
    if not listed_anywhere and unsupported:
        return "skipped", "NVML cannot list processes here: " + "; ".join(unsupported)
    return "failed", f"NVML does not list this process (pid {pid}) on any device it shows"


def _pid_visible(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _load_nvml() -> tuple[ModuleType | None, str]:
    try:
        import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types
    except ImportError:
        return None, "NVML: nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"NVML: {e}"
    return pynvml, ""


def _load_torch() -> tuple[Any, str]:
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        return None, f"torch.cuda.is_available() is False (PyTorch {torch.__version__}, {build})"
    return torch, ""


def run(env: Mapping[str, str]) -> tuple[int, Report, str]:
    """(exit status, the checks' report, the closing line)."""
    share = share_spec(env)
    report = Report()
    nvml, nvml_reason = _load_nvml()
    try:
        devices = nvml_devices(nvml) if nvml is not None else []
        torch, torch_reason = _load_torch()
        if torch is None:
            if share.cpu_only or not devices:
                why = "; ".join(r for r in (torch_reason, nvml_reason) if r) or "no device"
                if share.cpu_only:
                    why = f"this server's share is CPU-only ({GPU_ENFORCEMENT_ENV}=cpu-only); {why}"
                elif share.inventory:
                    why = f"the hub's GPUs here are {share.inventory}, not real; {why}"
                return SKIPPED, report, f"skipped: no GPU: {why}"
            report.add("torch", "failed", f"NVML shows {len(devices)} device(s) but {torch_reason}")
            return FAILED, report, "failed: 1 of 1 checks"
        if share.cpu_only:
            report.add(
                "cpu-only",
                "failed",
                f"the share is CPU-only but PyTorch sees {torch.cuda.device_count()} GPU(s): "
                "NVIDIA_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES widened it",
            )
            return FAILED, report, "failed: 1 of 1 checks"
        _check_devices(torch, share, report)
        _check_matmul(torch, report)
        held = _hold_memory(torch)
        if nvml is None:
            report.add("nvml", "failed", f"PyTorch sees a GPU but {nvml_reason}")
        else:
            outcome, detail = nvml_sees_process(
                nvml, devices, share, os.getpid(), held.numel(), _pid_visible
            )
            report.add("nvml", outcome, detail)
        del held
        torch.cuda.empty_cache()
        _check_limit(torch, share, report)
    finally:
        if nvml is not None:
            nvml.nvmlShutdown()
    failed = report.outcomes().count("failed")
    passed = report.outcomes().count("passed")
    skipped = report.outcomes().count("skipped")
    if failed:
        return FAILED, report, f"failed: {failed} of {len(report.lines)} checks"
    return PASSED, report, f"passed: {passed} passed, {skipped} skipped"


def _check_devices(torch: Any, share: ShareSpec, report: Report) -> None:
    count = torch.cuda.device_count()
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    if share.uuids and count != len(share.uuids):
        report.add("torch", "failed", f"PyTorch sees {count} GPU(s), the share names {share.uuids}")
    else:
        report.add("torch", "passed", f"torch.cuda.is_available(): {count} GPU(s): {names}")


def _check_matmul(torch: Any, report: Report) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # compare full fp32 products
    generator = torch.Generator().manual_seed(19)
    a = torch.randn(1024, 1024, generator=generator)
    b = torch.randn(1024, 1024, generator=generator)
    on_gpu = (a.cuda() @ b.cuda()).cpu()
    expected = a @ b
    error = float((on_gpu - expected).abs().max())
    if torch.allclose(on_gpu, expected, rtol=1e-3, atol=1e-3):
        report.add("matmul", "passed", f"1024x1024 fp32 on the GPU; max error {error:.2e}")
    else:
        report.add("matmul", "failed", f"the GPU's product differs from the CPU's by {error:.3g}")


def _hold_memory(torch: Any) -> Any:
    """256 MiB on the GPU, so NVML has something of this process's to list."""
    held = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    held.fill_(1)
    torch.cuda.synchronize()
    return held


def _check_limit(torch: Any, share: ShareSpec, report: Report) -> None:
    limit = share.memory_limit_mib
    if share.enforcement in NOT_ENFORCED:
        report.add("limit", "skipped", NOT_ENFORCED[share.enforcement])
        return
    if limit is None:
        why = "whole GPUs: no memory limit below the devices' own"
        if not share.enforcement:
            why = "no gpulab share in the environment (not started by a gpulab spawner)"
        report.add("limit", "skipped", why)
        return
    enforcer = ENFORCED_BY.get(share.enforcement)
    if enforcer is None:
        report.add("limit", "skipped", f"unknown enforcement {share.enforcement!r}")
        return
    within, beyond = limit // 2, limit + max(256, limit // 8)
    try:
        block = torch.empty(within * MIB, dtype=torch.uint8, device="cuda")
        del block
    except torch.cuda.OutOfMemoryError as e:
        report.add("limit", "failed", f"{within} MiB, within the {limit} MiB share, failed: {e}")
        return
    torch.cuda.empty_cache()
    try:
        block = torch.empty(beyond * MIB, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        report.add(
            "limit",
            "passed",
            f"{within} MiB allocated, {beyond} MiB refused: {enforcer} holds the {limit} MiB share",
        )
        return
    del block
    report.add(
        "limit",
        "failed",
        f"{beyond} MiB allocated beyond the {limit} MiB share that {enforcer} should enforce",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpulab-gpu-smoke-test", description=__doc__)
    parser.parse_args(argv)
    status, report, closing = run(os.environ)
    for check, outcome, detail in report.lines:
        print(f"{PREFIX}: {check}: {outcome}: {detail}")
    print(f"{PREFIX}: {closing}")
    return status


if __name__ == "__main__":
    sys.exit(main())
