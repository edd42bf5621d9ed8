"""The labelled FAKE pynvml (fake_nvml/pynvml.py) and ways to put it in front of real code.

`installed(machine)` makes `import pynvml` in this process return the fake over `machine`;
`subprocess_env(machine, path)` is the environment that does the same for a server or any other
child process (its folder first on PYTHONPATH, the machine in a JSON file, and optionally a table
of what each call costs, as bench.monitor uses)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

FOLDER = Path(__file__).parent


def _load() -> ModuleType:
    """A fresh copy of the fake, registered as sys.modules["pynvml"] (its dataclasses need it
    there while the module runs)."""
    spec = importlib.util.spec_from_file_location("pynvml", FOLDER / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pynvml"] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def installed(machine: dict[str, Any] | None) -> Iterator[ModuleType]:
    """`import pynvml` returns the fake over `machine` (None: no driver) inside the block."""
    saved = sys.modules.get("pynvml")
    fake = _load()
    fake.load_machine(machine)
    try:
        yield fake
    finally:
        if saved is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = saved


MACHINE_ENV = "GPULAB_FAKE_NVML_MACHINE"
COSTS_ENV = "GPULAB_FAKE_NVML_COSTS"


def subprocess_env(
    machine: dict[str, Any], path: Path, pythonpath: str = "", costs: Path | None = None
) -> dict[str, str]:
    """Environment for a child process whose `import pynvml` is the fake over `machine`
    (written to `path`), each call costing what the JSON table `costs` says."""
    path.write_text(json.dumps(machine))
    env = {
        MACHINE_ENV: str(path),
        "PYTHONPATH": f"{FOLDER}:{pythonpath}" if pythonpath else str(FOLDER),
    }
    if costs is not None:
        env[COSTS_ENV] = str(costs)
    return env


def a100(i: int, **extra: Any) -> dict[str, Any]:
    """An A100-SXM4-80GB as the fake describes it (NVLinked to the others of a test machine)."""
    gpu = {
        "uuid": f"GPU-fa4e0000-0000-4000-8000-{i:012d}",
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_mib": 81920,
        "bus_id": f"00000000:{7 + i:02x}:00.0",
        "mig_capable": True,
    }
    gpu.update(extra)
    return gpu


def mig_instance(
    gpu: int, slot: int, profile: str, memory_mib: int, **extra: Any
) -> dict[str, Any]:
    inst = {
        "slot": slot,
        "uuid": f"MIG-fa4e{gpu:04d}-{slot:04d}-4000-8000-000000000000",
        "profile": profile,
        "memory_mib": memory_mib,
    }
    inst.update(extra)
    return inst
