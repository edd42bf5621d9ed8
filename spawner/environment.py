"""From a placement to what a local process needs: device visibility, fractional-GPU enforcement,
and a plain statement of how strong that enforcement is (pure: no JupyterHub imports).

Without Kubernetes there are two ways to hold a process to a fraction of a GPU:
- CUDA MPS, when an MPS control daemon runs: the driver caps the client's device memory and its
  share of SMs;
- framework caps otherwise: PyTorch, TensorFlow and JAX are told to stay within the share. That is
  cooperative (raw CUDA code ignores it), so the NVML watchdog backs it up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulab.spawner.names import (
    CAPS_HOOK_ENV,
    GPU_DEVICE_MEMORY_MIB_ENV,
    GPU_ENFORCEMENT_ENV,
    GPU_FRACTION_ENV,
    GPU_MEMORY_LIMIT_MIB_ENV,
    GPU_MODEL_ENV,
    GPU_UUIDS_ENV,
    ISOLATION_ENV,
)

EXCLUSIVE = "exclusive"
MIG = "mig"
MPS = "mps"
FRAMEWORK_CAPS = "framework-caps"
CPU_ONLY = "cpu-only"

#: directory holding gpulab's sitecustomize, which applies the framework caps at import time
CAPS_HOOK_DIR = str(Path(__file__).parent / "singleuser" / "gpu_caps")


@dataclass(frozen=True)
class AssignedGPU:
    uuid: str
    model: str
    memory_mib: int  # a MIG instance's own
    milli: int  # 1000 = whole GPU
    mig_profile: str | None = None  # a MIG instance: the hardware holds it to its memory

    @property
    def memory_limit_mib(self) -> int:
        if self.mig_profile:
            return self.memory_mib
        # floor: a share never promises more memory than the GPU has
        return self.memory_mib * self.milli // 1000

    @property
    def model_name(self) -> str:
        """As NVML names the device ('A100-SXM4-80GB MIG 2g.20gb' for a MIG instance)."""
        return f"{self.model} MIG {self.mig_profile}" if self.mig_profile else self.model


def assigned_gpus(shares: Iterable[Any], gpu_of: Callable[[str], Any]) -> list[AssignedGPU]:
    """The GPUs of a placement's shares (``GpuShare``: uuid, milli), with the model, memory and
    MIG profile of the inventory's GPU behind each (``gpu_of(uuid)``: ``GPUCapacity.gpu_by_uuid``),
    as job attempts and Dask workers get them."""
    gpus = []
    for share in shares:
        gpu = gpu_of(share.uuid)
        gpus.append(
            AssignedGPU(share.uuid, gpu.model, gpu.memory_mib, share.milli, gpu.mig_profile)
        )
    return gpus


@dataclass(frozen=True)
class Enforcement:
    mechanism: str
    isolation: str  # one sentence a user reads in the picker and in their server's environment


def enforcement_for(gpus: Sequence[AssignedGPU], *, mps_available: bool) -> Enforcement:
    if not gpus:
        return Enforcement(CPU_ONLY, "No GPU: GPUs are hidden from this server.")
    if all(g.milli == 1000 for g in gpus):
        n = len(gpus)
        return Enforcement(
            EXCLUSIVE,
            f"Exclusive: {'this GPU is' if n == 1 else f'these {n} GPUs are'} yours alone "
            "while the server runs.",
        )
    g = gpus[0]
    if g.mig_profile:
        return Enforcement(
            MIG,
            f"MIG instance {g.mig_profile}: the GPU's hardware holds you to {g.memory_mib} MiB "
            "and your own compute slices; no other server shares its memory or faults.",
        )
    if mps_available:
        return Enforcement(
            MPS,
            f"Shared GPU, enforced by CUDA MPS: the driver caps you at {g.memory_limit_mib} MiB "
            f"and {_percent(g.milli)}% of the GPU's SMs; a crash of another MPS client on the "
            "same GPU can affect you.",
        )
    return Enforcement(
        FRAMEWORK_CAPS,
        f"Shared GPU, cooperative caps: PyTorch, TensorFlow and JAX are limited to "
        f"{g.memory_limit_mib} MiB; other CUDA code is not, and a server that stays over its share "
        "is warned, then stopped.",
    )


def _percent(milli: int) -> int:
    # MPS takes whole percents; round up so a 1/8 share is 13 %, never 0 %
    return max(1, math.ceil(milli / 10))


def gpu_environment(
    gpus: Sequence[AssignedGPU],
    *,
    mps_pipe_directory: str = "",
    mps_log_directory: str = "",
) -> tuple[dict[str, str], Enforcement]:
    """Environment variables for a server holding `gpus`, and the enforcement they amount to."""
    enforcement = enforcement_for(gpus, mps_available=bool(mps_pipe_directory))
    env: dict[str, str] = {ISOLATION_ENV: enforcement.isolation}
    if not gpus:
        # An empty CUDA_VISIBLE_DEVICES hides every GPU; unset would expose them all.
        env.update(CUDA_VISIBLE_DEVICES="", NVIDIA_VISIBLE_DEVICES="void")
        env[GPU_ENFORCEMENT_ENV] = enforcement.mechanism
        return env, enforcement
    uuids = ",".join(g.uuid for g in gpus)
    env.update(
        CUDA_VISIBLE_DEVICES=uuids,
        NVIDIA_VISIBLE_DEVICES=uuids,
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
    )
    env.update({GPU_UUIDS_ENV: uuids, GPU_ENFORCEMENT_ENV: enforcement.mechanism})
    if gpus[0].model:
        env[GPU_MODEL_ENV] = gpus[0].model_name
    if gpus[0].memory_mib:
        env[GPU_DEVICE_MEMORY_MIB_ENV] = str(gpus[0].memory_mib)
    if enforcement.mechanism == EXCLUSIVE:
        return env, enforcement

    g = gpus[0]
    limit = g.memory_limit_mib
    env.update({GPU_FRACTION_ENV: f"{g.milli / 1000:.3f}", GPU_MEMORY_LIMIT_MIB_ENV: str(limit)})
    if enforcement.mechanism == MIG:
        return env, enforcement  # CUDA_VISIBLE_DEVICES=MIG-<uuid>: the hardware enforces it
    if enforcement.mechanism == MPS:
        env.update(
            CUDA_MPS_PIPE_DIRECTORY=mps_pipe_directory,
            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(_percent(g.milli)),
            # device ordinal as the client sees it: CUDA_VISIBLE_DEVICES leaves it exactly one GPU
            CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"0={limit}M",
        )
        if mps_log_directory:
            env["CUDA_MPS_LOG_DIRECTORY"] = mps_log_directory
    else:
        env.update(
            # the allocator returns freed blocks instead of caching them past the cap
            PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,garbage_collection_threshold:0.8",
            # JAX preallocates exactly its share instead of 75 % of the device
            XLA_PYTHON_CLIENT_MEM_FRACTION=f"{g.milli / 1000:.3f}",
            TF_FORCE_GPU_ALLOW_GROWTH="true",
        )
        # gpulab's sitecustomize caps torch and tensorflow once they are imported
        env[CAPS_HOOK_ENV] = "1"
    return env, enforcement


def with_caps_hook(pythonpath: str | None) -> str:
    """PYTHONPATH with gpulab's caps hook first."""
    return CAPS_HOOK_DIR if not pythonpath else f"{CAPS_HOOK_DIR}:{pythonpath}"
