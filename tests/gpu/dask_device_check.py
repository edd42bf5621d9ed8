"""gpulab's Dask worker on a real NVIDIA GPU: one short script for a machine that has one.

CI machines have no GPU and cannot install dask-cuda (its rapids dependency does not build
there), so the suite covers the worker's choice of launcher and the share-aware dashboard
figures over the labelled fake pynvml. This script runs the real thing on a GPU machine, with
only the Python that machine has plus the wheels handed to it (distributed, dask, dask-cuda and
cuda-core, unpacked into a temporary folder: the machine has no package index):

1. the worker launcher (`gpulab.spawner.singleuser.dask_worker --gpu`) on a 1/4 share of the
   first GPU, with the environment the executors give a worker (`gpu_environment`, the caps
   hook), starts dask-cuda's worker and says so, with `--device-memory-limit` at the share;
2. that worker joins a scheduler as exactly one worker, sees one GPU, and a task's PyTorch
   gets 8 GiB but is refused more than the share (the framework caps apply inside dask-cuda's
   worker processes too);
3. with the preload executors pass (`jupyterlab_gpulab.dask_preload`), the worker's GPU
   figures (what the dashboard's GPU panes draw) are the share's: memory total = the share's
   limit, not the device's, and memory used is the worker's own;
4. after the worker and scheduler are stopped, NVML lists no process of theirs on the GPU.

Usage (repository root, on the GPU machine):
`python3 tests/gpu/dask_device_check.py --wheels DIR [--json PATH]`, DIR holding one folder of
wheels per Python version (`py3.11/...`). Exits 1 if any check failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from device_check import Checks, map_package  # noqa: E402

GIB = 1024**3
MIB = 1024**2
PRELOAD = "jupyterlab_gpulab.dask_preload"

# runs in the worker: PyTorch on its share (the caps hook applies at import)
TORCH_TASK = """
def torch_on_share(hold_mib, extra_mib):
    import torch
    report = {"visible": torch.cuda.device_count()}
    kept = torch.empty(hold_mib * 2**20, dtype=torch.uint8, device="cuda")
    try:
        more = torch.empty(extra_mib * 2**20, dtype=torch.uint8, device="cuda")
        report["extra"] = "allocated"
        del more
    except torch.OutOfMemoryError:
        report["extra"] = "refused"
    report["held_mib"] = kept.numel() // 2**20
    return report
"""


def unpack_wheels(wheels: Path) -> Path:
    """The wheels for this Python, unpacked into a folder put first on every path (a wheel is a
    zip of what pip would install; its dist-info keeps the entry points `dask cuda` needs)."""
    folder = wheels / f"py{sys.version_info.major}.{sys.version_info.minor}"
    if not folder.is_dir():
        raise SystemExit(f"no wheels for Python {sys.version.split()[0]} in {wheels}")
    target = Path(tempfile.mkdtemp(prefix="gpulab-dask-wheels-"))
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    sys.path.insert(0, str(target))
    return target


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            try:
                return dict(json.loads(path.read_text()))
            except ValueError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        time.sleep(0.2)
    raise TimeoutError(f"no {path.name} within {timeout} s")


def log_fd(path: Path) -> int:
    """A descriptor for a child's log (the child keeps it; this process never reads through it)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", required=True, type=Path)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    map_package()
    unpacked = unpack_wheels(args.wheels.resolve())

    from gpulab.hub.inventory import discover_nvml, nvml_available
    from gpulab.spawner.environment import AssignedGPU, gpu_environment, with_caps_hook

    ok, why = nvml_available()
    if not ok:
        print(f"no GPU here: {why}")
        return 2
    import pynvml
    from distributed import Client

    checks = Checks()
    gpu = discover_nvml(node_name="device-check").gpus[0]
    share = AssignedGPU(uuid=gpu.uuid, model=gpu.model, memory_mib=gpu.memory_mib, milli=250)
    share_env, _ = gpu_environment([share])
    paths = [str(unpacked), os.environ["GPULAB_DEVICE_CHECK_PATH"]]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPULAB_", "CUDA_"))}
    base["PYTHONPATH"] = os.pathsep.join(paths)
    work = Path(tempfile.mkdtemp(prefix="gpulab-dask-check-"))

    scheduler_file = work / "scheduler.json"
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--no-dashboard", "--scheduler-file", str(scheduler_file)],
        env={**base, "CUDA_VISIBLE_DEVICES": ""}, cwd=work,
        stdout=log_fd(work / "scheduler.log"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    worker = None
    try:
        address = wait_for_file(scheduler_file, scheduler, 60)["address"]
        worker_env = {**base, **share_env, "PYTHONPATH": with_caps_hook(base["PYTHONPATH"])}
        began = time.monotonic()
        worker_log = work / "worker.log"
        worker = subprocess.Popen(
            [sys.executable, "-m", "gpulab.spawner.singleuser.dask_worker", "--gpu", "--",
             address, "--name", "w1", "--nthreads", "1", "--preload", PRELOAD],
            env=worker_env, cwd=work, stdout=log_fd(worker_log), stderr=subprocess.STDOUT,
        )  # fmt: skip
        client = Client(address, timeout=60)
        client.wait_for_workers(1, timeout=180)
        up_s = round(time.monotonic() - began, 2)
        time.sleep(2)  # a dask-cuda worker that would start one per visible GPU has done so
        log_text = worker_log.read_text(errors="replace")
        first = log_text.splitlines()[0] if log_text else ""
        limit_mib = share.memory_limit_mib
        checks.check(
            "on a 1/4 share the launcher starts dask-cuda's worker and says so",
            "dask-cuda" in first and "Traceback" not in log_text,
            {"first_line": first, "worker_up_s": up_s},
        )
        info = client.scheduler_info()["workers"]
        checks.check(
            "it joins as exactly one worker (CUDA_VISIBLE_DEVICES holds the share's GPU only)",
            len(info) == 1,
            {"workers": [w.get("name") for w in info.values()]},
        )

        def device_memory_limit(dask_worker: Any) -> Any:
            # dask-cuda's DeviceHostFile: device memory is a zict Buffer spilling past `n` bytes
            return getattr(getattr(dask_worker.data, "device_buffer", None), "n", None)

        limits = list(client.run(device_memory_limit).values())
        checks.check(
            "dask-cuda spills at the share's memory (--device-memory-limit), not the device's",
            bool(limits) and limits[0] is not None and abs(limits[0] - limit_mib * MIB) < MIB,
            {"device_memory_limit": limits, "share_mib": limit_mib},
        )
        namespace: dict[str, Any] = {}
        exec(TORCH_TASK, namespace)
        report = client.submit(namespace["torch_on_share"], 8192, limit_mib + 4096).result(300)
        checks.check(
            "a task's PyTorch sees one GPU, gets 8 GiB, and is refused more than the share",
            report.get("visible") == 1 and report.get("extra") == "refused",
            report,
        )

        def gpu_figures(dask_worker: Any) -> dict[str, Any]:
            monitor = dask_worker.monitor
            return {
                "name": monitor.gpu_name,
                "memory_total": monitor.gpu_memory_total,
                "memory_used": list(monitor.quantities.get("gpu_memory_used", []))[-1:],
                "preloaded": hasattr(dask_worker, "_gpulab_share_monitor"),
            }

        time.sleep(3)  # the share sampler's next samples
        (figures,) = client.run(gpu_figures).values()
        checks.check(
            "the dashboard's GPU figures are the share's (memory total = the 1/4 limit)",
            figures["preloaded"] and abs(figures["memory_total"] - limit_mib * MIB) < MIB,
            {**figures, "device_mib": gpu.memory_mib, "share_mib": limit_mib},
        )
        client.close()
    except Exception as e:  # the checks so far are printed; this one says what broke
        checks.check("the Dask worker on a GPU share ran", False, f"{type(e).__name__}: {e}")
        for name in ("scheduler.log", "worker.log"):
            path = work / name
            if path.exists():
                print(f"--- {name} (last 3000 chars)\n{path.read_text(errors='replace')[-3000:]}")
    finally:
        if worker is not None:
            stop(worker)
        stop(scheduler)

    pids = {p for p in (scheduler.pid, worker.pid if worker else None) if p}
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    time.sleep(2)
    left = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    children = subprocess.run(
        ["pgrep", "-f", "distributed.cli|dask_worker|dask cuda"], capture_output=True, text=True
    ).stdout.split()
    checks.check(
        "after stop no worker or scheduler process is left, and none holds the GPU",
        not children and not (set(left) & pids),
        {"gpu_processes": left, "dask_processes": children},
    )
    print(f"dask_device_checks={len(checks.results)} failed={checks.failed} gpu={gpu.model}")
    if args.json:
        Path(args.json).write_text(json.dumps(checks.results, indent=2))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
