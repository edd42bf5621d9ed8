"""gpulab framework caps: hold PyTorch and TensorFlow to this server's share of a GPU.

Loaded through PYTHONPATH by gpulab's local spawner when the server holds a fraction of a GPU and no
MPS daemon enforces it. It waits for the framework to be imported (importing torch eagerly would
cost every Python process a second), then applies the cap from GPULAB_GPU_MEMORY_LIMIT_MIB.
These caps are cooperative: code that calls CUDA directly is not held by them.
"""

import importlib.abc
import importlib.util
import os
import sys


def _limit_mib():
    try:
        return int(os.environ["GPULAB_GPU_MEMORY_LIMIT_MIB"])
    except (KeyError, ValueError):
        return None


def _cap_torch(torch):
    fraction = float(os.environ.get("GPULAB_GPU_FRACTION", "0") or 0)
    if fraction <= 0 or not torch.cuda.is_available():
        return
    for device in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def _cap_tensorflow(tf):
    limit = _limit_mib()
    if limit is None:
        return
    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)]
        )


_HOOKS = {"torch": _cap_torch, "tensorflow": _cap_tensorflow}


class _CapAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _HOOKS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module, _original=original_exec, _hook=_HOOKS[name]):
            _original(module)
            try:
                _hook(module)
            except Exception as e:  # a cap that fails must not break the import
                print(f"gpulab: could not apply the GPU share cap to {name}: {e}", file=sys.stderr)

        loader.exec_module = exec_module
        return spec


if os.environ.get("GPULAB_CAPS_HOOK") == "1":
    sys.meta_path.insert(0, _CapAfterImport())
