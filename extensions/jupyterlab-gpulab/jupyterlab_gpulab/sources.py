"""Device sources behind one interface: real NVML, simulated devices, or none (no driver).

A source is called from the sampler thread only: `sample()` blocks for as long as the NVML calls
take and must never run on the event loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpulab.spawner.names import DECLARED_INVENTORY, SIMULATED_INVENTORY

from .procs import is_own, process_name
from .share import Share, is_mig_uuid

log = logging.getLogger(__name__)

MIB = 1024 * 1024
NO_DRIVER_MESSAGE = "No NVIDIA driver on this machine: GPU figures are unavailable"


@dataclass(frozen=True)
class DeviceInfo:
    uuid: str
    name: str
    index: int  # the physical GPU's NVML index (a MIG slice carries its parent's)
    mig: bool
    whole: bool  # the server owns the device outright: temperature and power are reported
    memory_total_mib: float
    memory_limit_mib: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    memory_mib: float
    own: bool
    name: str


@dataclass(frozen=True)
class DeviceSample:
    utilization_pct: float | None
    memory_used_mib: float
    memory_limit_mib: float
    temperature_c: float | None = None
    power_w: float | None = None
    processes: tuple[ProcessInfo, ...] = ()
    # "device": the whole device's figure (for a fractional share that includes neighbours);
    # "own_processes": summed over this user's processes only
    utilization_scope: str = "device"
    memory_scope: str = "device"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["processes"] = [asdict(p) for p in self.processes]
        return out


class Source:
    """One interface for every source; `calls` counts the NVML(-like) calls made."""

    kind = "none"
    simulated = False

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._calls_lock = threading.Lock()  # counted in the sampler thread, read on the loop
        self.message = ""
        self.process_list_seconds = 0.0
        self._process_list_read: dict[str, float] = {}

    def count(self, name: str) -> None:
        with self._calls_lock:
            self.calls[name] += 1

    def process_list_due(self, uuid: str, every_sample: bool) -> bool:
        """Whether to read this device's process list now (see GPUMonitor.process_list_seconds).

        A fraction of a shared GPU counts its memory from its own processes, so it reads the
        list every sample; a whole GPU or a MIG slice reads memory from the device and only names
        its processes, which change rarely: NVML's slowest per-device query every few seconds.
        """
        now = time.monotonic()
        last = self._process_list_read.get(uuid)
        if every_sample or last is None or now - last >= self.process_list_seconds:
            self._process_list_read[uuid] = now
            return True
        return False

    def call_counts(self) -> dict[str, int]:
        with self._calls_lock:
            return dict(self.calls)

    def devices(self) -> list[DeviceInfo]:
        raise NotImplementedError

    def sample(self) -> dict[str, DeviceSample]:
        """Blocking: read every device once. Called from the sampler thread only."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class NoDriverSource(Source):
    """NVML did not initialise and simulation is off: no devices, a message saying why."""

    def __init__(self, message: str = NO_DRIVER_MESSAGE) -> None:
        super().__init__()
        self.message = message

    def devices(self) -> list[DeviceInfo]:
        return []

    def sample(self) -> dict[str, DeviceSample]:
        return {}


# -- real NVML ---------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class _Handle:
    info: DeviceInfo
    handle: Any
    last_process_sample_us: int = 0
    processes: tuple[ProcessInfo, ...] = ()  # the last process list read


class NvmlSource(Source):
    """The devices this server owns, read through pynvml (nvidia-ml-py).

    pynvml calls are ctypes calls, which release the GIL while the driver works, so the sampler
    thread holds the interpreter only for the Python around them.
    """

    kind = "nvml"

    def __init__(
        self,
        share: Share,
        env: Mapping[str, str] | None = None,
        *,
        process_list_seconds: float = 0.0,
    ) -> None:
        super().__init__()
        self.process_list_seconds = process_list_seconds
        import pynvml  # nvidia-ml-py

        self.nvml = pynvml
        self.share = share
        pynvml.nvmlInit()  # raises pynvml.NVMLError without a driver
        self.count("nvmlInit")
        try:
            self._handles = self._resolve(share, os.environ if env is None else env)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        missing = [u for u in share.uuids if u not in {h.info.uuid for h in self._handles}]
        if missing:
            self.message = (
                f"GPU(s) {', '.join(missing)} assigned to this server are not visible to NVML here"
            )
        elif not self._handles:
            self.message = "This server holds no GPU"
        self._uid = os.getuid()
        self._server_pid = os.getpid()

    def _call(self, name: str, *args: Any) -> Any:
        self.count(name)
        return getattr(self.nvml, name)(*args)

    def _all_handles(self) -> dict[str, tuple[Any, int, bool]]:
        """Every GPU and MIG device by UUID: (handle, physical index, is MIG)."""
        nv = self.nvml
        out: dict[str, tuple[Any, int, bool]] = {}
        for i in range(self._call("nvmlDeviceGetCount")):
            handle = self._call("nvmlDeviceGetHandleByIndex", i)
            out[_text(self._call("nvmlDeviceGetUUID", handle))] = (handle, i, False)
            try:
                current, _pending = self._call("nvmlDeviceGetMigMode", handle)
            except nv.NVMLError:
                continue  # not MIG-capable
            if current != nv.NVML_DEVICE_MIG_ENABLE:
                continue
            for j in range(self._call("nvmlDeviceGetMaxMigDeviceCount", handle)):
                try:
                    mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, j)
                except nv.NVMLError:
                    continue  # no MIG device at this slot
                out[_text(self._call("nvmlDeviceGetUUID", mig))] = (mig, i, True)
        return out

    def _resolve(self, share: Share, env: Mapping[str, str]) -> list[_Handle]:
        found = self._all_handles()
        if share.uuids:
            wanted = [u for u in share.uuids if u in found]
        elif "CUDA_VISIBLE_DEVICES" in env:
            # not started by gpulab: follow CUDA's view ("" hides every GPU)
            entries = [e.strip() for e in env["CUDA_VISIBLE_DEVICES"].split(",") if e.strip()]
            by_index = {str(idx): u for u, (_, idx, mig) in found.items() if not mig}
            wanted = [by_index.get(e, e) for e in entries if by_index.get(e, e) in found]
        else:
            wanted = [u for u, (_, _, mig) in found.items() if not mig]
        handles = []
        for uuid in wanted:
            handle, index, mig = found[uuid]
            total = self._call("nvmlDeviceGetMemoryInfo", handle).total / MIB
            limit = total if share.memory_limit_mib is None else min(total, share.memory_limit_mib)
            info = DeviceInfo(
                uuid=uuid,
                name=_text(self._call("nvmlDeviceGetName", handle)),
                index=index,
                mig=mig or is_mig_uuid(uuid),
                whole=share.whole and not mig,
                memory_total_mib=total,
                memory_limit_mib=limit,
            )
            handles.append(_Handle(info, handle))
        return handles

    def devices(self) -> list[DeviceInfo]:
        return [h.info for h in self._handles]

    def sample(self) -> dict[str, DeviceSample]:
        return {h.info.uuid: self._sample_one(h) for h in self._handles}

    def _optional(self, name: str, *args: Any) -> Any:
        try:
            return self._call(name, *args)
        except self.nvml.NVMLError:
            return None

    def _sample_one(self, h: _Handle) -> DeviceSample:
        nv, info = self.nvml, h.info
        rates = self._optional("nvmlDeviceGetUtilizationRates", h.handle)
        utilization = float(rates.gpu) if rates is not None else None  # MIG: usually unsupported
        mem = self._call("nvmlDeviceGetMemoryInfo", h.handle)
        fraction = not info.whole and not info.mig
        if self.process_list_due(info.uuid, every_sample=fraction):
            h.processes = tuple(
                ProcessInfo(
                    pid=int(p.pid),
                    memory_mib=(getattr(p, "usedGpuMemory", None) or 0) / MIB,
                    own=is_own(p.pid, self._uid, self._server_pid),
                    name=process_name(p.pid),
                )
                for p in self._optional("nvmlDeviceGetComputeRunningProcesses", h.handle) or []
            )
        processes = h.processes
        memory_used, memory_scope = mem.used / MIB, "device"
        utilization_scope = "device"
        temperature = power = None
        if info.whole:
            temperature = self._optional(
                "nvmlDeviceGetTemperature", h.handle, nv.NVML_TEMPERATURE_GPU
            )
            milliwatts = self._optional("nvmlDeviceGetPowerUsage", h.handle)
            power = milliwatts / 1000 if milliwatts is not None else None
        elif fraction:
            # a fraction of a shared GPU: this user's own processes, where NVML can tell them apart
            memory_used = sum(p.memory_mib for p in processes if p.own)
            memory_scope = "own_processes"
            own_util = self._own_utilization(h, {p.pid for p in processes if p.own})
            if own_util is not None:
                utilization, utilization_scope = own_util, "own_processes"
        return DeviceSample(
            utilization_pct=utilization,
            memory_used_mib=memory_used,
            memory_limit_mib=info.memory_limit_mib,
            temperature_c=float(temperature) if temperature is not None else None,
            power_w=power,
            processes=tuple(processes),
            utilization_scope=utilization_scope,
            memory_scope=memory_scope,
        )

    def _own_utilization(self, h: _Handle, own_pids: set[int]) -> float | None:
        """SM % of this user's processes since the last sample; None when NVML cannot say."""
        nv = self.nvml
        try:
            samples = self._call(
                "nvmlDeviceGetProcessUtilization", h.handle, h.last_process_sample_us
            )
        except nv.NVMLError as e:
            if getattr(e, "value", None) == nv.NVML_ERROR_NOT_FOUND:
                return 0.0  # no process ran on the GPU since the last sample
            return None
        per_pid: dict[int, list[float]] = {}
        for s in samples:
            h.last_process_sample_us = max(h.last_process_sample_us, int(s.timeStamp))
            if s.pid in own_pids:
                per_pid.setdefault(s.pid, []).append(float(s.smUtil))
        return min(100.0, sum(sum(v) / len(v) for v in per_pid.values()))

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


# -- simulated ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Latencies:
    """Seconds each simulated NVML call takes (measured on real drivers; configurable)."""

    utilization: float = 2.5e-6
    memory: float = 12e-6
    processes: float = 4.5e-3
    temperature: float = 0.0
    power: float = 0.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> Latencies:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown simulated latency {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**{k: float(v) for k, v in values.items()})


# Below this a wait is a spin (time.sleep cannot wait a few microseconds: Linux rounds it up to
# ~60 us); above it, a sleep, which releases the GIL as a real ctypes call into the driver does.
SPIN_BELOW_SECONDS = 200e-6


def spend(seconds: float) -> None:
    """Take `seconds`, as an NVML call would: spin for microseconds, sleep for milliseconds."""
    if seconds <= 0:
        return
    if seconds >= SPIN_BELOW_SECONDS:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


#: the simulated device when the spawner names no model (a bare server, a test)
SIMULATED_GPU = ("Simulated NVIDIA H100 80GB HBM3", 81559.0)
SIMULATED_MIG = ("Simulated NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9984.0)
CPU_ONLY_MESSAGE = "This server has no GPU (its profile is CPU-only)"
SIMULATED_MESSAGE = (
    "Simulated GPUs: these figures are generated, not measured "
    "(GPUMonitor.source or GPULAB_MONITOR_SOURCE is 'simulated')"
)
_SCRIPTABLE = {"utilization_pct", "memory_used_mib", "temperature_c", "power_w", "processes"}


def simulated_uuid(i: int) -> str:
    return f"GPU-00000000-5eed-4000-8000-{i:012d}"


@dataclass
class _Walk:
    """A moving but reproducible workload: a slow wave with a random walk on top."""

    rng: random.Random
    phase: float
    utilization: float = 30.0
    memory_fraction: float = 0.3
    extra: dict[str, float] = field(default_factory=dict)

    def step(self, t: float) -> tuple[float, float]:
        wave = 45 + 35 * math.sin(2 * math.pi * t / 300 + self.phase)
        self.utilization += self.rng.gauss(0, 4) + 0.2 * (wave - self.utilization)
        self.utilization = min(100.0, max(0.0, self.utilization))
        self.memory_fraction += self.rng.gauss(0, 0.01)
        self.memory_fraction = min(0.9, max(0.05, self.memory_fraction))
        return self.utilization, self.memory_fraction


class ScriptFile:
    """GPULAB_SIMULATED_GPU_FILE: {uuid or "*": {figure: value}}, re-read when it changes."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._stamp: tuple[int, int] | None = None
        self.figures: dict[str, dict[str, Any]] = {}
        self.error = ""

    def current(self) -> dict[str, dict[str, Any]]:
        if self.path is None:
            return {}
        try:
            st = self.path.stat()
        except OSError:
            self._stamp, self.figures = None, {}
            return self.figures
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                data = json.loads(self.path.read_text())
                if not isinstance(data, dict) or not all(
                    isinstance(v, dict) for v in data.values()
                ):
                    raise ValueError('expected {"<uuid>" or "*": {"utilization_pct": 97, ...}}')
                self.figures, self.error = data, ""
            except (OSError, ValueError) as e:
                self.error = f"{self.path}: {e}"
                log.warning("gpulab monitor: ignoring simulated figures file %s", self.error)
        return self.figures


class SimulatedSource(Source):
    """Clearly labelled simulated devices that cost what real NVML calls cost."""

    kind = "simulated"
    simulated = True

    def __init__(
        self,
        share: Share,
        *,
        device_count: int = 1,
        latencies: Latencies | None = None,
        script_path: str | os.PathLike[str] | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        process_list_seconds: float = 0.0,
    ) -> None:
        super().__init__()
        self.process_list_seconds = process_list_seconds
        self.share = share
        self.latencies = latencies or Latencies()
        self.script = ScriptFile(script_path)
        self.clock = clock
        self.message = SIMULATED_MESSAGE
        uuids = share.uuids or tuple(simulated_uuid(i) for i in range(device_count))
        if share.cpu_only:
            uuids, self.message = (), CPU_ONLY_MESSAGE
        self._devices = []
        self._walks = {}
        for index, uuid in enumerate(uuids):
            mig = is_mig_uuid(uuid) or " MIG " in share.model
            name, total = SIMULATED_MIG if mig else SIMULATED_GPU
            if share.model:  # the GPU the hub placed this server on
                name = f"Simulated NVIDIA {share.model}"
                total = share.device_memory_mib or share.memory_limit_mib or total
            limit = total if share.memory_limit_mib is None else min(total, share.memory_limit_mib)
            self._devices.append(
                DeviceInfo(uuid, name, index, mig, share.whole and not mig, total, limit)
            )
            rng = random.Random(zlib.crc32(uuid.encode()) ^ seed)
            self._walks[uuid] = _Walk(rng, phase=rng.uniform(0, 2 * math.pi))
        self._lock = threading.Lock()  # calls counter and walks; sample() may be called by tests

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def _nvml_call(self, name: str, seconds: float) -> None:
        self.count(name)
        spend(seconds)

    def sample(self) -> dict[str, DeviceSample]:
        with self._lock:
            if not self._devices:
                return {}
            t = self.clock()
            script = self.script.current()
            if self.script.error:
                self.message = f"{SIMULATED_MESSAGE}; {self.script.error}"
            else:
                self.message = SIMULATED_MESSAGE
            return {d.uuid: self._sample_one(d, t, script) for d in self._devices}

    def _sample_one(
        self, d: DeviceInfo, t: float, script: dict[str, dict[str, Any]]
    ) -> DeviceSample:
        lat = self.latencies
        self._nvml_call("nvmlDeviceGetUtilizationRates", lat.utilization)
        self._nvml_call("nvmlDeviceGetMemoryInfo", lat.memory)
        if self.process_list_due(d.uuid, every_sample=not d.whole and not d.mig):
            self._nvml_call("nvmlDeviceGetComputeRunningProcesses", lat.processes)
        utilization, memory_fraction = self._walks[d.uuid].step(t)
        figures: dict[str, Any] = {
            "utilization_pct": round(utilization, 1),
            "memory_used_mib": round(memory_fraction * d.memory_limit_mib, 1),
            "temperature_c": None,
            "power_w": None,
        }
        if d.whole:
            self._nvml_call("nvmlDeviceGetTemperature", lat.temperature)
            self._nvml_call("nvmlDeviceGetPowerUsage", lat.power)
            figures["temperature_c"] = round(32 + 0.45 * utilization, 1)
            figures["power_w"] = round(70 + 6.3 * utilization, 1)
        for key in ("*", d.uuid):
            figures.update({k: v for k, v in script.get(key, {}).items() if k in _SCRIPTABLE})
        if "processes" in figures:
            processes = tuple(
                ProcessInfo(
                    int(p["pid"]),
                    float(p.get("memory_mib", 0)),
                    bool(p.get("own", True)),
                    str(p.get("name", "")),
                )
                for p in figures.pop("processes")
            )
        else:
            processes = (
                ProcessInfo(os.getpid(), figures["memory_used_mib"], True, "python (simulated)"),
            )

        def num(v: Any) -> float | None:
            return None if v is None else float(v)

        return DeviceSample(
            utilization_pct=num(figures["utilization_pct"]),
            memory_used_mib=float(figures["memory_used_mib"]),
            memory_limit_mib=d.memory_limit_mib,
            temperature_c=num(figures["temperature_c"]),
            power_w=num(figures["power_w"]),
            processes=processes,
            memory_scope="device" if d.whole or d.mig else "own_processes",
        )


def select_source(
    mode: str,
    share: Share,
    *,
    simulated_device_count: int = 1,
    latencies: Latencies | None = None,
    script_path: str | None = None,
    process_list_seconds: float = 0.0,
) -> Source:
    """mode: "auto" (NVML if it initialises; else the simulated source where the spawner says
    the share's devices are declared or simulated, none otherwise), "nvml", "simulated" or
    "none". A CPU-only server shows no GPU in any mode: any GPU it could see is not its own."""
    if share.cpu_only:
        return NoDriverSource(CPU_ONLY_MESSAGE)
    if mode == "simulated":
        return SimulatedSource(
            share,
            device_count=simulated_device_count,
            latencies=latencies,
            script_path=script_path,
            process_list_seconds=process_list_seconds,
        )
    if mode == "none":
        return NoDriverSource("GPU monitoring is off (GPUMonitor.source = 'none')")
    try:
        return NvmlSource(share, process_list_seconds=process_list_seconds)
    except Exception as e:  # pynvml.NVMLError, ImportError, OSError from ctypes
        if mode == "auto" and share.inventory in (DECLARED_INVENTORY, SIMULATED_INVENTORY):
            log.info("gpulab monitor: no NVML; simulating the %s GPUs", share.inventory)
            return SimulatedSource(
                share,
                latencies=latencies,
                script_path=script_path,
                process_list_seconds=process_list_seconds,
            )
        log.info("gpulab monitor: NVML unavailable (%s); GPU figures are off", e)
        return NoDriverSource(NO_DRIVER_MESSAGE)
