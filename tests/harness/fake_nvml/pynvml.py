"""FAKE NVML, for tests only: the part of nvidia-ml-py's `pynvml` that gpulab calls, over a
declared machine instead of a driver. Never installed outside tests; `FAKE = True` says so, and
nothing in gpulab imports this module by name (tests put its folder first on sys.path or
PYTHONPATH, or install it as `sys.modules["pynvml"]`).

It keeps NVML's semantics where gpulab's code depends on them: reference-counted nvmlInit /
nvmlShutdown, NVMLError subclasses with NVML's return codes (calls before nvmlInit raise
Uninitialized; a machine without a driver raises DriverNotLoaded), MIG parents whose MIG device
slots raise NotFound when empty, MIG devices that raise NotSupported for utilisation,
temperature and power (as real drivers do), process lists with host pids, NVLink state and
remote PCI bus ids, process utilisation samples that raise NotFound when no process ran. It also
answers what jupyterlab-nvdashboard's handlers call (NVLink version and field values, PCIe link
generation, width and throughput), so bench.monitor can run nvdashboard over it.

Each call can cost what a real one does: `load_costs(table)` or, in a subprocess, the JSON file
named by GPULAB_FAKE_NVML_COSTS (bench/data/nvml_call_costs.json has the cited figures). A "cpu"
cost burns the CPU with the GIL released (hashing, in C), as a ctypes call into the driver does;
a "wait" cost sleeps (NVML's documented sampling windows). With no table, calls cost nothing.

The machine comes from `load_machine(dict)` or, in a subprocess, the JSON file named by
GPULAB_FAKE_NVML_MACHINE:

    {"gpus": [{"uuid": "GPU-…", "name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920,
               "bus_id": "00000000:07:00.0", "nvlink_to": ["00000000:08:00.0"],
               "mig_capable": true, "utilization": 40, "memory_used_mib": 1200,
               "temperature": 51, "power_mw": 250000,
               "processes": [{"pid": 4242, "memory_mib": 1000, "sm_util": 30}],
               "mig": {"max": 7, "instances": [{"slot": 0, "uuid": "MIG-…",
                        "profile": "2g.20gb", "memory_mib": 19968, "memory_used_mib": 0,
                        "processes": [...]}]}}]}

`CALLS` counts every call by name, so tests can check how often code initialises NVML. Names the
fake makes up itself say FAKE; the test machines' UUIDs start GPU-fa4e/MIG-fa4e.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

FAKE = True
MACHINE_ENV = "GPULAB_FAKE_NVML_MACHINE"
COSTS_ENV = "GPULAB_FAKE_NVML_COSTS"

# return codes and constants as nvidia-ml-py defines them
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0
NVML_NVLINK_MAX_LINKS = 36
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
# NVML_FI_DEV_NVLINK_SPEED_MBPS_L0 .. _L11 as nvidia-ml-py numbers them (84..89, 132..137)
for _i, _field in enumerate((84, 85, 86, 87, 88, 89, 132, 133, 134, 135, 136, 137)):
    globals()[f"NVML_FI_DEV_NVLINK_SPEED_MBPS_L{_i}"] = _field
_NVLINK_SPEED_FIELDS = frozenset((84, 85, 86, 87, 88, 89, 132, 133, 134, 135, 136, 137))
MIB = 1024 * 1024

CALLS: Counter[str] = Counter()


class NVMLError(Exception):
    _names = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    }

    def __new__(cls, value: int) -> NVMLError:
        # like pynvml: NVMLError(code) is an instance of that code's subclass
        sub = _SUBCLASSES.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(sub)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._names.get(self.value, f"NVML error {self.value}")


class NVMLError_Uninitialized(NVMLError): ...  # noqa: N801 - pynvml's names


class NVMLError_InvalidArgument(NVMLError): ...  # noqa: N801


class NVMLError_NotSupported(NVMLError): ...  # noqa: N801


class NVMLError_NotFound(NVMLError): ...  # noqa: N801


class NVMLError_DriverNotLoaded(NVMLError): ...  # noqa: N801


class NVMLError_LibraryNotFound(NVMLError): ...  # noqa: N801


_SUBCLASSES = {
    NVML_ERROR_UNINITIALIZED: NVMLError_Uninitialized,
    NVML_ERROR_INVALID_ARGUMENT: NVMLError_InvalidArgument,
    NVML_ERROR_NOT_SUPPORTED: NVMLError_NotSupported,
    NVML_ERROR_NOT_FOUND: NVMLError_NotFound,
    NVML_ERROR_DRIVER_NOT_LOADED: NVMLError_DriverNotLoaded,
    NVML_ERROR_LIBRARY_NOT_FOUND: NVMLError_LibraryNotFound,
}


@dataclass
class c_nvmlMemory_t:  # noqa: N801
    total: int
    free: int
    used: int


@dataclass
class c_nvmlUtilization_t:  # noqa: N801
    gpu: int
    memory: int


@dataclass
class c_nvmlPciInfo_t:  # noqa: N801
    busId: str  # noqa: N815


@dataclass
class c_nvmlProcessInfo_t:  # noqa: N801
    pid: int
    usedGpuMemory: int | None  # noqa: N815


@dataclass
class c_nvmlProcessUtilizationSample_t:  # noqa: N801
    pid: int
    timeStamp: int  # noqa: N815
    smUtil: int  # noqa: N815
    memUtil: int  # noqa: N815


@dataclass
class c_nvmlValue_t:  # noqa: N801
    ullVal: int  # noqa: N815


@dataclass
class c_nvmlFieldValue_t:  # noqa: N801
    fieldId: int  # noqa: N815
    scopeId: int  # noqa: N815
    timestamp: int
    latencyUsec: int  # noqa: N815
    valueType: int  # noqa: N815
    nvmlReturn: int  # noqa: N815
    value: c_nvmlValue_t


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig_slot: int | None = None


_machine: dict[str, Any] | None = None
_init_count = 0
_costs: dict[str, tuple[float, str]] = {}
_default_cost: tuple[float, str] = (0.0, "cpu")
_BURN_CHUNK = bytes(4096)  # hashlib releases the GIL for inputs over 2 KiB


def load_costs(table: dict[str, Any] | None) -> None:
    """What each call costs, in bench/data/nvml_call_costs.json's shape
    ({"default": {"seconds", "kind"}, "calls": {name: {"seconds", "kind"}}}); None: free."""
    global _costs, _default_cost
    table = table or {}
    entry = table.get("default") or {}
    _default_cost = (float(entry.get("seconds", 0.0)), str(entry.get("kind", "cpu")))
    _costs = {
        name: (float(e["seconds"]), str(e.get("kind", "cpu")))
        for name, e in (table.get("calls") or {}).items()
    }


def _spend(name: str) -> None:
    seconds, kind = _costs.get(name, _default_cost)
    if seconds <= 0:
        return
    if kind == "wait":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.sha1(_BURN_CHUNK).digest()


def load_machine(machine: dict[str, Any] | None) -> None:
    """Declare the machine (None: no driver) and forget any init count and call counts."""
    global _machine, _init_count
    _machine, _init_count = machine, 0
    CALLS.clear()


def _load_from_env() -> None:
    path = os.environ.get(MACHINE_ENV)
    if path and _machine is None:
        with open(path) as f:
            load_machine(json.load(f))
    costs = os.environ.get(COSTS_ENV)
    if costs and not _costs:
        with open(costs) as f:
            load_costs(json.load(f))


def _check(name: str) -> None:
    CALLS[name] += 1
    if _init_count <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _spend(name)


def nvmlInit() -> None:  # noqa: N802
    global _init_count
    CALLS["nvmlInit"] += 1
    _load_from_env()
    if _machine is None:
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
    _init_count += 1


def nvmlShutdown() -> None:  # noqa: N802
    global _init_count
    _check("nvmlShutdown")
    _init_count -= 1


def _gpus() -> list[dict[str, Any]]:
    assert _machine is not None
    return list(_machine.get("gpus", []))


def _dev(handle: _Handle) -> dict[str, Any]:
    gpu = _gpus()[handle.gpu]
    if handle.mig_slot is None:
        return gpu
    for inst in (gpu.get("mig") or {}).get("instances", []):
        if inst["slot"] == handle.mig_slot:
            return dict(inst, name=f"{gpu.get('name', 'FAKE NVIDIA GPU')} MIG {inst['profile']}")
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetCount() -> int:  # noqa: N802
    _check("nvmlDeviceGetCount")
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:  # noqa: N802
    _check("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(_gpus()):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(index)


def nvmlDeviceGetUUID(handle: _Handle) -> str:  # noqa: N802
    _check("nvmlDeviceGetUUID")
    return str(_dev(handle)["uuid"])


def nvmlDeviceGetName(handle: _Handle) -> str:  # noqa: N802
    _check("nvmlDeviceGetName")
    return str(_dev(handle).get("name", "FAKE NVIDIA GPU"))


def nvmlDeviceGetMemoryInfo(handle: _Handle) -> c_nvmlMemory_t:  # noqa: N802
    _check("nvmlDeviceGetMemoryInfo")
    dev = _dev(handle)
    total = int(dev["memory_mib"]) * MIB
    used = int(dev.get("memory_used_mib", 0)) * MIB
    return c_nvmlMemory_t(total=total, free=total - used, used=used)


def nvmlDeviceGetPciInfo(handle: _Handle) -> c_nvmlPciInfo_t:  # noqa: N802
    _check("nvmlDeviceGetPciInfo")
    return c_nvmlPciInfo_t(
        busId=_gpus()[handle.gpu].get("bus_id", f"00000000:{handle.gpu:02x}:00.0")
    )


def nvmlDeviceGetNvLinkState(handle: _Handle, link: int) -> int:  # noqa: N802
    _check("nvmlDeviceGetNvLinkState")
    peers = _gpus()[handle.gpu].get("nvlink_to", [])
    if "nvlink_to" not in _gpus()[handle.gpu]:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # a PCIe card without NVLink
    return NVML_FEATURE_ENABLED if link < len(peers) else NVML_FEATURE_DISABLED


def nvmlDeviceGetNvLinkRemotePciInfo(handle: _Handle, link: int) -> c_nvmlPciInfo_t:  # noqa: N802
    _check("nvmlDeviceGetNvLinkRemotePciInfo")
    peers = _gpus()[handle.gpu].get("nvlink_to", [])
    if link >= len(peers):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return c_nvmlPciInfo_t(busId=peers[link])


def nvmlDeviceGetMigMode(handle: _Handle) -> tuple[int, int]:  # noqa: N802
    _check("nvmlDeviceGetMigMode")
    gpu = _dev(handle)
    if handle.mig_slot is not None or not gpu.get("mig_capable", bool(gpu.get("mig"))):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    mode = NVML_DEVICE_MIG_ENABLE if gpu.get("mig") else NVML_DEVICE_MIG_DISABLE
    return mode, mode


def nvmlDeviceGetMaxMigDeviceCount(handle: _Handle) -> int:  # noqa: N802
    _check("nvmlDeviceGetMaxMigDeviceCount")
    mig = _dev(handle).get("mig")
    return int(mig.get("max", 7)) if mig else 0


def nvmlDeviceGetMigDeviceHandleByIndex(handle: _Handle, index: int) -> _Handle:  # noqa: N802
    _check("nvmlDeviceGetMigDeviceHandleByIndex")
    mig = _dev(handle).get("mig") or {}
    if not any(inst["slot"] == index for inst in mig.get("instances", [])):
        raise NVMLError(NVML_ERROR_NOT_FOUND)  # an empty slot
    return _Handle(handle.gpu, index)


def nvmlDeviceIsMigDeviceHandle(handle: _Handle) -> int:  # noqa: N802
    _check("nvmlDeviceIsMigDeviceHandle")
    return int(handle.mig_slot is not None)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: _Handle) -> _Handle:  # noqa: N802
    _check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
    if handle.mig_slot is None:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(handle.gpu)


def _whole_only(handle: _Handle, name: str) -> dict[str, Any]:
    _check(name)
    if handle.mig_slot is not None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # MIG devices have no sensors of their own
    return _dev(handle)


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> c_nvmlUtilization_t:  # noqa: N802
    dev = _whole_only(handle, "nvmlDeviceGetUtilizationRates")
    return c_nvmlUtilization_t(gpu=int(dev.get("utilization", 0)), memory=0)


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:  # noqa: N802
    return int(_whole_only(handle, "nvmlDeviceGetTemperature").get("temperature", 40))


def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:  # noqa: N802
    return int(_whole_only(handle, "nvmlDeviceGetPowerUsage").get("power_mw", 100_000))


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[c_nvmlProcessInfo_t]:  # noqa: N802
    _check("nvmlDeviceGetComputeRunningProcesses")
    return [
        c_nvmlProcessInfo_t(pid=int(p["pid"]), usedGpuMemory=int(p.get("memory_mib", 0)) * MIB)
        for p in _dev(handle).get("processes", [])
    ]


def nvmlDeviceGetProcessUtilization(  # noqa: N802
    handle: _Handle, last_seen_timestamp: int
) -> list[c_nvmlProcessUtilizationSample_t]:
    dev = _whole_only(handle, "nvmlDeviceGetProcessUtilization")
    stamp = int(dev.get("sample_time_us", 1_000_000))
    samples = [
        c_nvmlProcessUtilizationSample_t(int(p["pid"]), stamp, int(p.get("sm_util", 0)), 0)
        for p in dev.get("processes", [])
        if stamp > last_seen_timestamp
    ]
    if not samples:
        raise NVMLError(NVML_ERROR_NOT_FOUND)  # no process ran since last_seen_timestamp
    return samples


# -- what jupyterlab-nvdashboard calls besides the above -------------------------------------


def nvmlDeviceGetNvLinkVersion(handle: _Handle, link: int) -> int:  # noqa: N802
    gpu = _whole_only(handle, "nvmlDeviceGetNvLinkVersion")
    if link >= len(gpu.get("nvlink_to", [])):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # no NVLink on this link (or this card)
    return int(gpu.get("nvlink_version", 4))


def nvmlDeviceGetFieldValues(  # noqa: N802
    handle: _Handle, field_ids: list[int | tuple[int, int]]
) -> list[c_nvmlFieldValue_t]:
    """NVLink speed (MB/s per link) and throughput (KiB counters) fields; every other field
    answers NOT_SUPPORTED in its own entry, as NVML does."""
    gpu = _whole_only(handle, "nvmlDeviceGetFieldValues")
    links = len(gpu.get("nvlink_to", []))
    out = []
    for entry in field_ids:
        field, scope = entry if isinstance(entry, tuple) else (entry, 0)
        ret, value = NVML_SUCCESS, 0
        if field in _NVLINK_SPEED_FIELDS:
            value = int(gpu.get("nvlink_speed_mbps", 25781)) if links else 0
        elif field in (
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        ):
            value = int(gpu.get("nvlink_kib", 0)) if scope < links else 0
        else:
            ret = NVML_ERROR_NOT_SUPPORTED
        out.append(
            c_nvmlFieldValue_t(
                field, scope, 0, 0, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, ret, c_nvmlValue_t(value)
            )
        )
    return out


def nvmlDeviceGetMaxPcieLinkGeneration(handle: _Handle) -> int:  # noqa: N802
    return int(_whole_only(handle, "nvmlDeviceGetMaxPcieLinkGeneration").get("pcie_gen", 5))


def nvmlDeviceGetMaxPcieLinkWidth(handle: _Handle) -> int:  # noqa: N802
    return int(_whole_only(handle, "nvmlDeviceGetMaxPcieLinkWidth").get("pcie_width", 16))


def nvmlDeviceGetPcieThroughput(handle: _Handle, counter: int) -> int:  # noqa: N802
    """KB/s over NVML's 20 ms counter window (the cost table makes the call take that long)."""
    gpu = _whole_only(handle, "nvmlDeviceGetPcieThroughput")
    if counter not in (NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(gpu.get("pcie_tx_kbps" if counter == NVML_PCIE_UTIL_TX_BYTES else "pcie_rx_kbps", 0))
