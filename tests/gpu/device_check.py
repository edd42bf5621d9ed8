"""gpulab's NVML and GPU paths on a real NVIDIA GPU: one short script for a machine that has one.

CI machines have no GPU, so the suite covers these paths over the labelled fake pynvml
(tests/harness/fake_nvml). This script runs the same code against a real driver, with only the
Python that such a machine has (nvidia-ml-py, PyTorch; no JupyterHub): it maps `gpulab.hub` and
`gpulab.spawner` onto the checkout as the installed package does, then checks

1. inventory: `discover_nvml` names every GPU with a model gpulab knows (the allocator's
   catalogue), its UUID and memory;
2. framework caps: a PyTorch process started as the local spawner starts a 1/4 share's kernel
   (the `gpu_caps` import hook, GPULAB_GPU_FRACTION) is refused an allocation beyond its share,
   where the same process without the hook gets it; CUDA_VISIBLE_DEVICES="" hides the GPU;
3. the memory watchdog: NVML's per-process list shows that process's memory, and
   `GPUMemoryWatchdog` warns, then stops, a server tree over a 4 GiB share, and leaves alone one
   within a larger share;
4. the monitor's share-aware sampler (`NvmlSource`): a whole GPU reports utilisation,
   temperature and power; a 1/4 share reports only its own processes' memory and none of the
   device's temperature;
5. kernel checkpoints of CUDA tensors: a namespace of 1 GiB of float32 on the GPU, a bf16 tensor,
   a Parameter and an `nn.Linear` on the GPU is saved (`NamespaceCheckpointer`, exact) and
   restored in a fresh process onto the GPU with equal values, and onto the CPU (with the
   fallback reported) in a process that sees no GPU; save and restore rates are printed.

Usage (repository root, on the GPU machine): `python3 tests/gpu/device_check.py [--json PATH]`.
Prints one line per check and a summary; exits 1 if any check failed, 2 if there is no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GPU_CAPS = REPO / "spawner" / "singleuser" / "gpu_caps"
MIB = 1024 * 1024

# A kernel-like process: import torch (the caps hook, when enabled, applies at import), hold
# `hold` MiB, try `extra` MiB more, report, then keep the GPU busy for `busy` seconds.
HOLDER = r"""
import json, sys, time
import torch
hold, extra, busy = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
report = {"visible": torch.cuda.device_count()}
if report["visible"]:
    kept = torch.empty(hold * 2**20, dtype=torch.uint8, device="cuda")
    try:
        more = torch.empty(extra * 2**20, dtype=torch.uint8, device="cuda")
        report["extra"] = "allocated"
        del more
    except torch.OutOfMemoryError:
        report["extra"] = "refused"
    torch.cuda.synchronize()
print(json.dumps(report), flush=True)
if report["visible"]:
    a = torch.randn(8192, 8192, device="cuda")
    end = time.time() + busy
    while time.time() < end:
        a = a @ a
        a = a / a.norm()
        torch.cuda.synchronize()
"""


# Save (argv[1] = "save") or restore ("restore") a namespace of CUDA tensors with gpulab's kernel
# checkpoint code; prints one JSON line.
CHECKPOINTER = r"""
import hashlib, json, sys, time
from pathlib import Path
import torch
from gpulab.spawner.singleuser.checkpoint import derive_user_key
from gpulab.spawner.singleuser.checkpoint.namespace import DEVICE_FALLBACKS
from gpulab.spawner.singleuser.checkpoint.saver import NamespaceCheckpointer
from gpulab.spawner.singleuser.checkpoint.store import CheckpointStore
mode, path, dev = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
store = CheckpointStore(path, derive_user_key(b"device-check-secret-0123", "u"), "u")
def digest(ns):
    out = {}
    for name, value in ns.items():
        if isinstance(value, torch.nn.Module):
            value = value.weight
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[name] = [str(value.device), str(value.dtype), hashlib.sha256(data).hexdigest()]
    return out
if mode == "save":
    torch.manual_seed(0)
    ns = {
        "w": torch.randn(256 * 2**20, device=dev),
        "half": torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16),
        "p": torch.nn.Parameter(torch.randn(4096, device=dev)),
        "model": torch.nn.Linear(1024, 1024).to(dev),
    }
    if dev != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    report = NamespaceCheckpointer(store).save(ns, exact=True)
    seconds = time.perf_counter() - start
    print(json.dumps({"committed": report.committed, "seconds": seconds, "digest": digest(ns)}))
else:
    ns = {}
    start = time.perf_counter()
    report = NamespaceCheckpointer(store).restore(ns)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"restored": sorted(report.restored), "failed": report.failed,
                      "fallbacks": dict(DEVICE_FALLBACKS), "seconds": seconds,
                      "digest": digest(ns)}))
"""


def map_package() -> None:
    """`gpulab.hub` -> hub/, `gpulab.spawner` -> spawner/ (as pyproject's package-dir does), and
    the lab extension's Python package, importable without installing anything."""
    root = Path(tempfile.mkdtemp(prefix="gpulab-pkg-"))
    (root / "gpulab").mkdir()
    for name in ("hub", "spawner"):
        (root / "gpulab" / name).symlink_to(REPO / name)
    paths = [str(root), str(REPO / "extensions" / "jupyterlab-gpulab")]
    sys.path[:0] = paths
    os.environ["GPULAB_DEVICE_CHECK_PATH"] = os.pathsep.join(paths)  # for its child processes


class Checks:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def check(self, name: str, ok: bool, detail: Any) -> bool:
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        return bool(ok)

    def run(self, name: str, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as e:  # one broken check must not hide the others
            self.check(name, False, f"raised {type(e).__name__}: {e}")

    @property
    def failed(self) -> int:
        return sum(not r["ok"] for r in self.results)


def start_holder(
    env_extra: dict[str, str], hold: int, extra: int, busy: float
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAB_")}
    env.update(env_extra)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(hold), str(extra), str(busy)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"holder exited with {proc.returncode} before reporting")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    map_package()

    from gpulab.hub.inventory import KNOWN_MODELS, discover_nvml, nvml_available

    # by file: the package's __init__ imports the spawner (JupyterHub), which this machine lacks
    spec = importlib.util.spec_from_file_location(
        "gpulab_watchdog", REPO / "spawner" / "local" / "watchdog.py"
    )
    assert spec is not None and spec.loader is not None
    watchdog_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = watchdog_module  # dataclasses look their module up there
    spec.loader.exec_module(watchdog_module)
    GPUMemoryWatchdog = watchdog_module.GPUMemoryWatchdog
    NvmlProcessMemory = watchdog_module.NvmlProcessMemory
    from jupyterlab_gpulab.share import share_from_env
    from jupyterlab_gpulab.sources import NvmlSource

    ok, why = nvml_available()
    if not ok:
        print(f"no GPU here: {why}")
        return 2
    checks = Checks()
    node = discover_nvml(node_name="device-check")
    gpu = node.gpus[0]
    uuid = gpu.uuid
    checks.check(
        "inventory names every GPU with a model gpulab knows",
        all(g.model in KNOWN_MODELS and g.uuid.startswith("GPU-") for g in node.gpus),
        [(g.model, g.uuid, g.memory_mib) for g in node.gpus],
    )
    known = KNOWN_MODELS.get(gpu.model)
    checks.check(
        "the catalogue's memory for that model is what the driver reports (±2 %)",
        known is not None and abs(known.memory_mib - gpu.memory_mib) <= 0.02 * gpu.memory_mib,
        {"driver_mib": gpu.memory_mib, "catalogue_mib": known.memory_mib if known else None},
    )

    quarter_mib = int(gpu.memory_mib * 0.25)
    hold_mib = 8192
    extra_mib = quarter_mib + 4096  # beyond the share, well within the device
    share_env = {
        "CUDA_VISIBLE_DEVICES": uuid,
        "PYTHONPATH": str(GPU_CAPS),
        "GPULAB_CAPS_HOOK": "1",
        "GPULAB_GPU_FRACTION": "0.25",
        "GPULAB_GPU_MEMORY_LIMIT_MIB": str(quarter_mib),
    }

    def uncapped_gets_it() -> None:
        proc, report = start_holder({"CUDA_VISIBLE_DEVICES": uuid}, hold_mib, extra_mib, 0)
        stop(proc)
        checks.check(
            f"without the caps hook a process gets {hold_mib}+{extra_mib} MiB (the control)",
            report.get("extra") == "allocated",
            report,
        )

    def hidden() -> None:
        proc, report = start_holder({"CUDA_VISIBLE_DEVICES": ""}, 0, 0, 0)
        stop(proc)
        checks.check(
            'CUDA_VISIBLE_DEVICES="" leaves no GPU visible', report["visible"] == 0, report
        )

    checks.run("control", uncapped_gets_it)
    checks.run("hidden", hidden)

    proc, report = start_holder(share_env, hold_mib, extra_mib, 60)
    try:
        checks.check(
            f"a 1/4 share's PyTorch is refused {extra_mib} MiB more beyond its {quarter_mib} MiB",
            report.get("visible") == 1 and report.get("extra") == "refused",
            report,
        )

        def nvml_process_memory() -> None:
            source = NvmlProcessMemory()
            try:
                seen = source.sample().get(uuid, {})
            finally:
                source.close()
            checks.check(
                "NVML's process list shows the share's process with its memory",
                seen.get(proc.pid, 0) >= hold_mib,
                {"pid": proc.pid, "mib": seen.get(proc.pid), "all": seen},
            )

        def watchdog() -> None:
            stages: dict[str, list[str]] = {"over": [], "within": []}

            async def watch() -> None:
                dog = GPUMemoryWatchdog(NvmlProcessMemory(), interval_seconds=0.5, grace_seconds=1)

                def record(key: str) -> Callable[[str, str], Any]:
                    async def on_over(stage: str, message: str) -> None:
                        stages[key].append(stage)

                    return on_over

                dog.watch("over", proc.pid, {uuid: 4096}, record("over"))
                dog.watch("within", proc.pid, {uuid: quarter_mib}, record("within"))
                deadline = time.monotonic() + 15
                while "stop" not in stages["over"] and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                dog.unwatch("over")
                dog.unwatch("within")
                await asyncio.sleep(0.6)  # its loop ends (and closes NVML) once nothing is watched

            asyncio.run(watch())
            checks.check(
                "the watchdog warns, then stops, a server over a 4 GiB share and not one within",
                stages["over"] == ["warn", "stop"] and stages["within"] == [],
                stages,
            )

        def share_sampler() -> None:
            quarter = NvmlSource(
                share_from_env(
                    {
                        "GPULAB_GPU_UUIDS": uuid,
                        "GPULAB_GPU_FRACTION": "0.25",
                        "GPULAB_GPU_MEMORY_LIMIT_MIB": str(quarter_mib),
                    }
                )
            )
            whole = NvmlSource(share_from_env({"GPULAB_GPU_UUIDS": uuid}))
            try:
                samples = []
                for _ in range(6):
                    samples.append((quarter.sample()[uuid], whole.sample()[uuid]))
                    time.sleep(0.5)
            finally:
                quarter.close()
                whole.close()
            q, w = samples[-1]
            own = [p for p in q.processes if p.own]
            checks.check(
                "a 1/4 share's monitor counts only its own processes' memory, within its limit",
                q.memory_scope == "own_processes"
                and q.memory_limit_mib == quarter_mib
                and q.memory_used_mib >= hold_mib
                and any(p.pid == proc.pid for p in own)
                and q.temperature_c is None,
                {
                    "memory_used_mib": round(q.memory_used_mib),
                    "limit": q.memory_limit_mib,
                    "own_pids": [p.pid for p in own],
                    "utilization": q.utilization_pct,
                    "utilization_scope": q.utilization_scope,
                },
            )
            busiest = max(s[1].utilization_pct or 0 for s in samples)
            checks.check(
                "a whole GPU's monitor reports utilisation, temperature and power under load",
                busiest > 0 and w.temperature_c is not None and w.power_w is not None,
                {"max_util": busiest, "temp_c": w.temperature_c, "power_w": w.power_w},
            )
            own_util = [s[0].utilization_pct for s in samples if s[0].utilization_scope != "device"]
            checks.check(
                "a 1/4 share's utilisation is its own processes' (NVML process utilisation)",
                bool(own_util) and max(u or 0 for u in own_util) > 0,
                {"own_utilization_samples": own_util},
            )

        checks.run("nvml process memory", nvml_process_memory)
        checks.run("watchdog", watchdog)
        checks.run("share sampler", share_sampler)
    finally:
        stop(proc)

    checks.run("checkpoints", lambda: cuda_checkpoints(checks, uuid))

    print(f"device_checks={len(checks.results)} failed={checks.failed} gpu={gpu.model}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu.model, "results": checks.results}))
    return 1 if checks.failed else 0


def cuda_checkpoints(checks: Checks, uuid: str) -> None:
    store = Path(tempfile.mkdtemp(prefix="gpulab-ckpt-"))

    def child(mode: str, visible: str, device: str = "cuda") -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAB_CHECKPOINT")}
        env.update(PYTHONPATH=os.environ["GPULAB_DEVICE_CHECK_PATH"], CUDA_VISIBLE_DEVICES=visible)
        out = subprocess.run(
            [sys.executable, "-c", CHECKPOINTER, mode, str(store), device],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode:
            raise RuntimeError(f"{mode} exited {out.returncode}: {out.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    saved = child("save", uuid)
    gib = 1 + 2 / 1024  # the float32 tensor plus the bf16 one, roughly
    on_gpu = child("restore", uuid)
    checks.check(
        "kernel checkpoints bring CUDA tensors, a Parameter and a module back onto the GPU",
        saved["committed"]
        and on_gpu["restored"] == ["half", "model", "p", "w"]
        and not on_gpu["failed"]
        and all(d[0] == "cuda:0" for d in on_gpu["digest"].values())
        and on_gpu["digest"] == saved["digest"],
        {
            "save_gib_per_s": round(gib / saved["seconds"], 2),
            "restore_gib_per_s": round(gib / on_gpu["seconds"], 2),
            "restored": on_gpu["restored"],
        },
    )
    on_cpu = child("restore", "")
    checks.check(
        "without a GPU the same checkpoint comes back on the CPU, the fallback reported",
        on_cpu["fallbacks"] == {"cuda:0": "cpu"}
        and all(d[0] == "cpu" for d in on_cpu["digest"].values())
        and {k: d[1:] for k, d in on_cpu["digest"].items()}
        == {k: d[1:] for k, d in saved["digest"].items()},
        {
            "fallbacks": on_cpu["fallbacks"],
            "seconds": round(on_cpu["seconds"], 2),
            "digest": on_cpu["digest"],
        },
    )


if __name__ == "__main__":
    sys.exit(main())
