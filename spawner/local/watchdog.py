"""The GPU memory watchdog: warn, then stop, a local server whose processes outgrow its GPU share.

Framework caps are cooperative, and CUDA_VISIBLE_DEVICES is only a variable a process may unset,
so this is what makes a share binding without Kubernetes. It samples per-process GPU memory
(NVML's compute-process list, or a simulated source where no driver exists), adds it up over each
server's process tree, and calls back once when a server goes over its share and again when it
stays over past the grace period. Every server is watched: a GPU that is not in a server's share
has a share of 0 MiB there, so a CPU-only server that opens a GPU anyway, or a whole-GPU server
on a neighbour's device, is over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

#: GPU uuid -> {pid: used MiB}
MemorySample = dict[str, dict[int, int]]


class ProcessMemorySource(Protocol):
    label: str

    def sample(self) -> MemorySample: ...


class NvmlProcessMemory:
    """Per-process GPU memory from the NVIDIA driver, per device a server can hold: a GPU, or
    each MIG instance of a MIG-enabled GPU (its processes are the instance's, not the parent's).

    NVML is initialised on the first sample and shut down by close(), not once per sample: an
    init walks every GPU, and the watchdog samples every few seconds for the hub's lifetime."""

    label = "nvml"

    def __init__(self) -> None:
        self._nvml: Any = None

    def _init(self) -> Any:
        if self._nvml is None:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        return self._nvml

    def sample(self) -> MemorySample:
        nv = self._init()
        out: MemorySample = {}
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            devices = [handle]
            try:
                mig_on = nv.nvmlDeviceGetMigMode(handle)[0] == nv.NVML_DEVICE_MIG_ENABLE
            except nv.NVMLError:  # NotSupported: not MIG-capable
                mig_on = False
            if mig_on:
                devices = []
                for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
                    try:
                        devices.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
                    except nv.NVMLError:  # NotFound: an empty slot
                        continue
            for device in devices:
                uuid = _text(nv.nvmlDeviceGetUUID(device))
                try:
                    procs = nv.nvmlDeviceGetComputeRunningProcesses(device)
                except nv.NVMLError:  # NotSupported on some devices: nothing to attribute
                    procs = []
                out[uuid] = {p.pid: int((p.usedGpuMemory or 0) // (1024 * 1024)) for p in procs}
        return out

    def close(self) -> None:
        if self._nvml is not None:
            nv, self._nvml = self._nvml, None
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class SimulatedProcessMemory:
    """SIMULATED per-process GPU memory, read from a JSON file {uuid: {pid: MiB}}: for machines
    without a GPU (tests, demos). Never used unless configured, and labelled as simulated."""

    label = "simulated"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def sample(self) -> MemorySample:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        return {
            uuid: {int(pid): int(mib) for pid, mib in procs.items()} for uuid, procs in raw.items()
        }


def process_tree(root_pid: int, proc: Path = Path("/proc")) -> set[int]:
    """root_pid and all its descendants (kernels are children of the Jupyter server)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may contain spaces and parentheses: parse after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, stack = set(), [root_pid]
    while stack:
        pid = stack.pop()
        if pid in tree:
            continue
        tree.add(pid)
        stack.extend(children.get(pid, ()))
    return tree


OverCallback = Callable[[str, str], Awaitable[None]]  # (stage 'warn' | 'stop', message)


@dataclass
class _Watched:
    pid: int
    limits_mib: Mapping[str, int]
    on_over: OverCallback
    over_since: float | None = None
    warned: bool = False
    stopped: bool = False


@dataclass
class GPUMemoryWatchdog:
    source: ProcessMemorySource
    interval_seconds: float = 5.0
    grace_seconds: float = 60.0
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("gpulab.watchdog"))
    _watched: dict[str, _Watched] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    def watch(
        self, key: str, pid: int, limits_mib: Mapping[str, int], on_over: OverCallback
    ) -> None:
        self._watched[key] = _Watched(pid, dict(limits_mib), on_over)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def unwatch(self, key: str) -> None:
        self._watched.pop(key, None)

    def is_watching(self, key: str) -> bool:
        return key in self._watched

    def usage(self, sample: MemorySample, pids: set[int]) -> dict[str, int]:
        return {
            uuid: sum(m for p, m in procs.items() if p in pids) for uuid, procs in sample.items()
        }

    def _check(self, sample: MemorySample, now: float) -> list[tuple[_Watched, str, str]]:
        """(server, stage, message) for servers that just went over or stayed over too long."""
        actions = []
        for key, w in list(self._watched.items()):
            if w.stopped:
                continue
            used = self.usage(sample, process_tree(w.pid))
            over = {
                u: (mib, w.limits_mib.get(u, 0))
                for u, mib in used.items()
                if mib > w.limits_mib.get(u, 0)
            }
            if not over:
                w.over_since, w.warned = None, False
                continue
            detail = "; ".join(
                f"{u}: {a} MiB used of a {lim} MiB share"
                if u in w.limits_mib
                else f"{u}: {a} MiB used of a GPU that is not in its share"
                for u, (a, lim) in over.items()
            )
            if w.over_since is None:
                w.over_since = now
            if not w.warned:
                w.warned = True
                actions.append(
                    (
                        w,
                        "warn",
                        f"{key} is over its GPU share ({detail}); it will be "
                        f"stopped if it stays over for {self.grace_seconds:g} s",
                    )
                )
            elif now - w.over_since >= self.grace_seconds:
                w.stopped = True
                actions.append(
                    (
                        w,
                        "stop",
                        f"{key} stayed over its GPU share for "
                        f"{now - w.over_since:.0f} s ({detail}); stopping it",
                    )
                )
        return actions

    async def _run(self) -> None:
        try:
            await self._loop()
        finally:
            close = getattr(self.source, "close", None)
            if close is not None:  # NVML stays initialised only while something is watched
                close()

    async def _loop(self) -> None:
        while self._watched:
            try:
                sample = await asyncio.to_thread(self.source.sample)
                actions = await asyncio.to_thread(self._check, sample, time.monotonic())
                for w, stage, message in actions:
                    (self.log.warning if stage == "warn" else self.log.error)(
                        "GPU watchdog (%s source): %s", self.source.label, message
                    )
                    await w.on_over(stage, message)
            except Exception:
                self.log.exception("GPU watchdog sampling failed; retrying")
            await asyncio.sleep(self.interval_seconds)
