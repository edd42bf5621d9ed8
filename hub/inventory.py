"""GPU inventory of one machine: discovered through NVML, or declared in the config where there is
no NVIDIA driver (pure apart from the lazily imported, optional `pynvml`).

A declared inventory is a statement by the admin ("8 x A100-SXM4-80GB"), not a measurement; every
place that shows it says so, so nobody mistakes a simulated machine for a real one.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from gpulab.hub.allocator import GPU, Node
from gpulab.spawner.names import DECLARED_INVENTORY, INVENTORY_LABEL, MIG_ENABLED_LABEL

DECLARED = DECLARED_INVENTORY  # the label servers read back in GPU_INVENTORY_ENV
NVML = "nvml"


@dataclass(frozen=True)
class GPUModelSpec:
    memory_mib: int
    mig_capable: bool
    #: SXM parts sit on an NVLink/NVSwitch baseboard: all GPUs of a node share one NVLink group
    nvlink: bool


#: Models an admin may declare without a GPU present. Names are NVML's, less the "NVIDIA " prefix.
KNOWN_MODELS: dict[str, GPUModelSpec] = {
    "A100-SXM4-80GB": GPUModelSpec(81920, True, True),
    "A100-SXM4-40GB": GPUModelSpec(40960, True, True),
    "A100-PCIE-80GB": GPUModelSpec(81920, True, False),
    "A100-PCIE-40GB": GPUModelSpec(40960, True, False),
    "A30": GPUModelSpec(24576, True, False),
    "A10": GPUModelSpec(23028, False, False),
    "A10G": GPUModelSpec(23028, False, False),
    "L4": GPUModelSpec(23034, False, False),
    "L40S": GPUModelSpec(46068, False, False),
    "T4": GPUModelSpec(15360, False, False),
    "V100-SXM2-16GB": GPUModelSpec(16384, False, True),
    "V100-SXM2-32GB": GPUModelSpec(32768, False, True),
    "H100-80GB-HBM3": GPUModelSpec(81559, True, True),
    "H100-PCIE": GPUModelSpec(81559, True, False),
    "H200": GPUModelSpec(143771, True, True),
    "B200": GPUModelSpec(183359, True, True),
    "RTX-A6000": GPUModelSpec(49140, False, False),
    "RTX-4090": GPUModelSpec(24564, False, False),
}


#: MIG profiles per GPU memory size: (compute slices out of 7, memory GB), smallest first
MIG_PROFILES_BY_MEMORY_GB: dict[int, list[tuple[int, int]]] = {
    40: [(1, 5), (2, 10), (3, 20), (4, 20), (7, 40)],
    80: [(1, 10), (2, 20), (3, 40), (4, 40), (7, 80)],
    94: [(1, 12), (2, 24), (3, 47), (4, 47), (7, 94)],
    141: [(1, 18), (2, 35), (3, 71), (4, 71), (7, 141)],
    24: [(1, 6), (2, 12), (4, 24)],  # A30
}

#: the most a part of a GPU holds: a device below a whole GPU never serves whole-GPU requests
PART_MAX_MILLI = 999
_MIG_PROFILE = re.compile(r"\b(\d)g\.(\d+)gb\b")


def mig_instance_milli(profile: str, gpu_memory_mib: int) -> int:
    """The part of its GPU a MIG instance is, by memory ('2g.20gb' of an 80 GB GPU: 250).

    MIG names memory in the GPU's nominal GB (an H200's 140.4 GiB is '141gb'), so the GPU's
    size is the nearest size MIG profiles are known for."""
    m = _MIG_PROFILE.search(profile)
    if not m:
        raise InventoryError(f"{profile!r} is not a MIG profile like '2g.20gb'")
    gpu_gb = min(MIG_PROFILES_BY_MEMORY_GB, key=lambda gb: abs(gb - gpu_memory_mib / 1024))
    return max(1, min(PART_MAX_MILLI, round(1000 * int(m.group(2)) / gpu_gb)))


def mig_profile_of(name: str) -> str | None:
    """'NVIDIA A100-SXM4-80GB MIG 2g.20gb' -> '2g.20gb' (NVML's MIG device names)."""
    m = _MIG_PROFILE.search(name)
    return f"{m.group(1)}g.{m.group(2)}gb" if m else None


class InventoryError(ValueError):
    """The declared inventory cannot be understood, or NVML discovery failed."""


_DECL_RE = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?([A-Za-z0-9][A-Za-z0-9_.-]*)\s*$")


def machine_cpu_milli() -> int:
    return (os.cpu_count() or 1) * 1000


def machine_memory_mib() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1024 * 1024))


def parse_declared(
    spec: str,
    *,
    node_name: str | None = None,
    cpu_milli: int | None = None,
    memory_mib: int | None = None,
) -> Node:
    """'8 x A100-SXM4-80GB' or '4 x A100-SXM4-80GB, 2 x T4' -> one Node with stable fake UUIDs.

    UUIDs are derived from the node name and position, so they stay the same across hub restarts
    (persisted allocations refer to them)."""
    node_name = node_name or socket.gethostname()
    if not isinstance(spec, str) or not spec.strip():
        raise InventoryError(
            "declared_inventory is empty; write it like '8 x A100-SXM4-80GB' (or '0 x' for CPU only)"
        )
    gpus: list[GPU] = []
    for part in spec.split(","):
        m = _DECL_RE.match(part)
        if not m:
            raise InventoryError(
                f"declared_inventory: cannot read {part.strip()!r}; write it like '8 x A100-SXM4-80GB'"
            )
        count = int(m.group(1) or 1)
        model = m.group(2)
        if model.upper().startswith("NVIDIA-"):
            model = model[len("NVIDIA-") :]
        if model not in KNOWN_MODELS:
            raise InventoryError(
                f"declared_inventory: unknown GPU model {model!r}; known models: "
                + ", ".join(sorted(KNOWN_MODELS))
            )
        if count > 64:
            raise InventoryError(
                f"declared_inventory: {count} GPUs of {model} on one machine is absurd"
            )
        spec_m = KNOWN_MODELS[model]
        for _ in range(count):
            index = len(gpus)
            digest = hashlib.sha1(f"{node_name}/{index}/{model}".encode()).hexdigest()
            uuid = (
                f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
            )
            gpus.append(
                GPU(
                    uuid=uuid,
                    model=model,
                    memory_mib=spec_m.memory_mib,
                    index=index,
                    mig_capable=spec_m.mig_capable,
                    nvlink_group=f"{node_name}/nvlink-{model}" if spec_m.nvlink else None,
                )
            )
    return Node(
        name=node_name,
        cpu_milli=cpu_milli if cpu_milli is not None else machine_cpu_milli(),
        memory_mib=memory_mib if memory_mib is not None else machine_memory_mib(),
        gpus=tuple(gpus),
        labels={INVENTORY_LABEL: DECLARED},
    )


def _model_name(raw: str | bytes) -> str:
    name = raw.decode() if isinstance(raw, bytes) else raw
    name = name.strip()
    if name.startswith("NVIDIA "):
        name = name[len("NVIDIA ") :]
    return name.replace(" ", "-")


def _as_str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def nvml_available() -> tuple[bool, str]:
    """(True, '') when NVML initialises, else (False, why)."""
    try:
        import pynvml
    except ImportError:
        return False, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return False, f"NVML could not initialise ({e}); no NVIDIA driver on this machine"
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        return False, "NVML reports no GPU"
    return True, ""


def discover_nvml(
    *, node_name: str | None = None, cpu_milli: int | None = None, memory_mib: int | None = None
) -> Node:
    """Real discovery: count, UUID, model, memory, MIG mode and NVLink peer groups of every GPU."""
    import pynvml

    node_name = node_name or socket.gethostname()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise InventoryError(f"NVML could not initialise: {e}") from e
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        bus_ids = [_as_str(pynvml.nvmlDeviceGetPciInfo(h).busId).lower() for h in handles]
        # Union-find over PCI bus ids: a GPU joins every endpoint its active NVLinks reach. Through an
        # NVSwitch all GPUs reach the same switch ids, so they end up in one group, as they should.
        parent: dict[str, str] = {}

        def find(x: str) -> str:
            parent.setdefault(x, x)
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        linked: set[str] = set()
        max_links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
        for h, bus in zip(handles, bus_ids, strict=True):
            find(bus)
            for link in range(max_links):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = _as_str(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower()
                except pynvml.NVMLError:
                    continue
                linked.add(bus)
                parent[find(bus)] = find(remote)
        gpus: list[GPU] = []
        mig_enabled: list[str] = []
        for index, (h, bus) in enumerate(zip(handles, bus_ids, strict=True)):
            uuid = _as_str(pynvml.nvmlDeviceGetUUID(h))
            mig_on = False
            try:
                current_mig, _pending = pynvml.nvmlDeviceGetMigMode(h)
                mig_capable = True
                mig_on = current_mig == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:  # NotSupported: not a MIG-capable GPU
                mig_capable = False
            gpu = GPU(
                uuid=uuid,
                model=_model_name(pynvml.nvmlDeviceGetName(h)),
                memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)),
                index=index,
                mig_capable=mig_capable,
                nvlink_group=f"{node_name}/nvlink-{find(bus)}" if bus in linked else None,
            )
            if mig_on:
                # a MIG-enabled GPU runs no CUDA work of its own: only its instances are
                # devices; with none configured it is left out (the label names it)
                mig_enabled.append(uuid)
                gpus.extend(_mig_instances(pynvml, h, gpu))
            else:
                gpus.append(gpu)
    finally:
        pynvml.nvmlShutdown()
    return Node(
        name=node_name,
        cpu_milli=cpu_milli if cpu_milli is not None else machine_cpu_milli(),
        memory_mib=memory_mib if memory_mib is not None else machine_memory_mib(),
        gpus=tuple(gpus),
        labels={INVENTORY_LABEL: NVML, MIG_ENABLED_LABEL: ",".join(mig_enabled)},
    )


def _mig_instances(pynvml: Any, parent_handle: Any, parent: GPU) -> list[GPU]:
    """The MIG instances of a MIG-enabled GPU, each a device holding one share of its profile's
    part of the GPU (what CUDA_VISIBLE_DEVICES=MIG-<uuid> gives a server)."""
    out: list[GPU] = []
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(parent_handle)):
        try:
            h = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent_handle, slot)
        except pynvml.NVMLError:  # NOT_FOUND: no instance in this slot
            continue
        profile = mig_profile_of(_as_str(pynvml.nvmlDeviceGetName(h)))
        if profile is None:
            continue
        milli = mig_instance_milli(profile, parent.memory_mib)
        out.append(
            GPU(
                uuid=_as_str(pynvml.nvmlDeviceGetUUID(h)),
                model=parent.model,
                memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)),
                index=parent.index,
                mig_capable=True,
                nvlink_group=None,  # an instance is never part of a multi-GPU request
                capacity_milli=milli,
                share_step_milli=milli,
                mig_profile=profile,
            )
        )
    return out
