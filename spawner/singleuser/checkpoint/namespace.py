"""From a kernel's user namespace to checkpoint blobs and back: which names are saved, how each
value is pickled, how cheaply a change is detected, and how values are rebuilt (no IPython imports).

Pickling: protocol 5 with out-of-band buffers, so numpy arrays (and pandas frames, whose blocks are
numpy arrays) are written straight from their memory with no pickle copy. The C pickler is tried
first; objects it cannot handle, and functions or classes defined in the notebook (which it would
save by reference to `__main__`, i.e. not at all), go to dill with `recurse=True` (a function
carries only the globals it uses). torch tensors are saved from a host copy of their bytes with
their device, dtype and requires_grad recorded, and rebuilt on that device when it exists (else on
the CPU, reported). Modules are recorded by name and imported again. What neither pickler can
handle is listed with the reason, never raised.

Change detection (what keeps the per-cell hook cheap): a value's fingerprint is a hash of its
in-band pickle plus, for each out-of-band buffer, its length and a *sampled* checksum (buffers up
to 1 MiB are hashed whole; larger ones at 1024 evenly spaced 256-byte blocks plus both ends, about
256 kB read whatever the size). Re-pickling only the in-band part is cheap because buffers are
passed by reference. torch tensors use their exact in-place version counter (`_version`) and skip
pickling while it is unchanged; immutable scalars compare by value. The trade-off: a sparse
in-place edit of a large numpy array (`a[5] = 1`) can escape the sampled checksum, so the per-cell
save may skip it; exact saves (shutdown, SIGTERM, `%gpulab_save`) compare the full HMAC of every
value and never miss a change. Values whose pickling took longer than the per-cell budget are
checked by identity only between exact saves.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import pickle
import re
import socket
import sys
import time
import types
import weakref
import zlib
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

SAMPLE_WHOLE_BYTES = 1 << 20
SAMPLE_BLOCKS = 1024
SAMPLE_BLOCK_BYTES = 256

#: IPython's own names in a user namespace (input/output history and helpers)
_IPYTHON_NAMES = re.compile(
    r"^(_|__|___|_i|_ii|_iii|_i\d+|_\d+|_oh|_ih|_dh|In|Out|exit|quit|get_ipython)$"
)
_SCALARS = (int, float, complex, bool, str, bytes, type(None))


class Unpicklable(Exception):
    """Neither pickler could save this value; the message says why."""


class _NeedsDill(Exception):
    pass


@dataclass
class Pickled:
    engine: str  # "pickle" or "dill"
    inband: memoryview
    buffers: list[memoryview]
    type_name: str
    seconds: float
    keep: list[Any] = field(default_factory=list)  # host copies the buffers point into

    @property
    def data_bytes(self) -> int:
        return self.inband.nbytes + sum(b.nbytes for b in self.buffers)

    def header(self) -> dict[str, Any]:
        return {"engine": self.engine, "type": self.type_name}

    def segments(self) -> list[memoryview]:
        return [self.inband, *self.buffers]


def type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def user_names(ns: Mapping[str, Any], hidden: Mapping[str, Any], keep: set[str]) -> list[str]:
    """Names a checkpoint saves: not IPython's history/helpers, not names IPython hid at start
    (unless gpulab restored them), not the checkpoint machinery itself."""
    out = []
    for name, value in ns.items():
        if _IPYTHON_NAMES.match(name) or name.startswith("__"):
            continue
        if name in hidden and hidden[name] is value and name not in keep:
            continue
        out.append(name)
    return out


# -- pickling ----------------------------------------------------------------------------------


def _torch() -> Any:
    return sys.modules.get("torch")


def _reduce_tensor(obj: Any) -> Any:
    torch = _torch()
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return NotImplemented
    if obj.layout != torch.strided or obj.is_quantized:
        return NotImplemented
    host = obj.detach().to("cpu").contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy()
    return (
        _rebuild_tensor,
        (
            raw,
            str(obj.dtype).removeprefix("torch."),
            tuple(obj.shape),
            str(obj.device),
            bool(obj.requires_grad),
            type(obj) is torch.nn.Parameter,
        ),
    )


#: devices tensors could not go back to during the last restore: {"cuda:1": "cpu"}
DEVICE_FALLBACKS: dict[str, str] = {}


def _device_available(torch: Any, device: str) -> bool:
    if device == "cpu":
        return True
    kind, _, index = device.partition(":")
    if kind == "cuda":
        return bool(torch.cuda.is_available()) and int(index or 0) < torch.cuda.device_count()
    backend = getattr(torch.backends, kind, None)
    return bool(backend is not None and getattr(backend, "is_available", lambda: False)())


def _rebuild_tensor(
    raw: Any, dtype: str, shape: tuple[int, ...], device: str, requires_grad: bool, parameter: bool
) -> Any:
    import torch

    t = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    if not _device_available(torch, device):
        DEVICE_FALLBACKS[device] = "cpu"
        device = "cpu"
    if device != "cpu":
        t = t.to(device)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _FastPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if (
            isinstance(obj, types.FunctionType | type)
            and getattr(obj, "__module__", None) == "__main__"
        ):
            raise _NeedsDill
        return _reduce_tensor(obj)


def _dill_pickler(file: io.BytesIO, callback: Callable[[pickle.PickleBuffer], bool]) -> Any:
    import dill

    class _DillPickler(dill.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            return _reduce_tensor(obj)

    return _DillPickler(file, protocol=5, buffer_callback=callback, recurse=True)


def pickle_value(obj: Any) -> Pickled:
    """Pickle one value (protocol 5, out-of-band buffers); Unpicklable if it cannot be done."""
    start = time.perf_counter()
    if isinstance(obj, io.IOBase | socket.socket):
        # dill would reopen files on restore, truncating those opened for writing
        raise Unpicklable(f"open {type(obj).__name__}: reopen it after the restore")
    errors = []
    for engine in ("pickle", "dill"):
        buffers: list[memoryview] = []

        def callback(pb: pickle.PickleBuffer, buffers: list[memoryview] = buffers) -> bool:
            try:
                buffers.append(pb.raw())
            except BufferError:
                return True  # not contiguous: keep it in band
            return False

        bio = io.BytesIO()
        try:
            if engine == "pickle":
                _FastPickler(bio, protocol=5, buffer_callback=callback).dump(obj)
            else:
                _dill_pickler(bio, callback).dump(obj)
        except _NeedsDill:
            continue
        except Exception as e:  # any failure of a third-party __reduce__ must not crash a save
            errors.append(f"{type(e).__name__}: {e}")
            continue
        return Pickled(
            engine, bio.getbuffer(), buffers, type_name(obj), time.perf_counter() - start
        )
    raise Unpicklable(errors[-1] if errors else "cannot be pickled")


def unpickle_value(header: Mapping[str, Any], segments: list[memoryview]) -> Any:
    inband, *buffers = segments
    if header.get("engine") == "dill":
        import dill

        return dill.loads(inband, buffers=buffers)
    return pickle.loads(inband, buffers=buffers)


# -- change detection --------------------------------------------------------------------------


def sampled_digest(buf: memoryview) -> bytes:
    """A cheap checksum of a buffer: whole when small, evenly spaced blocks when large."""
    n = buf.nbytes
    if n <= SAMPLE_WHOLE_BYTES:
        return zlib.crc32(buf).to_bytes(4, "little")
    import numpy as np

    arr = np.frombuffer(buf, dtype=np.uint8)
    rows = n // SAMPLE_BLOCK_BYTES
    grid = arr[: rows * SAMPLE_BLOCK_BYTES].reshape(rows, SAMPLE_BLOCK_BYTES)
    sample = grid[np.linspace(0, rows - 1, SAMPLE_BLOCKS).astype(np.intp)]
    head = zlib.crc32(memoryview(sample))  # type: ignore[arg-type]
    tail = zlib.crc32(memoryview(arr[-4096:]))  # type: ignore[arg-type]
    return head.to_bytes(4, "little") + tail.to_bytes(4, "little")


def fingerprint(p: Pickled) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(p.engine.encode())
    h.update(p.inband)
    for b in p.buffers:
        h.update(b.nbytes.to_bytes(8, "little"))
        h.update(sampled_digest(b))
    return h.hexdigest()


def quick_key(obj: Any) -> tuple[Any, ...] | None:
    """An exact change key that needs no pickling, where one exists."""
    if type(obj) in _SCALARS:
        if isinstance(obj, str | bytes) and len(obj) > 256:
            data = obj.encode("utf-8", "surrogatepass") if isinstance(obj, str) else obj
            return ("scalar", type(obj).__name__, hashlib.blake2b(data, digest_size=16).digest())
        return ("scalar", type(obj).__name__, obj)
    torch = _torch()
    if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
        return (
            "tensor",
            obj._version,
            tuple(obj.shape),
            str(obj.dtype),
            str(obj.device),
            obj.data_ptr(),
            obj.requires_grad,
        )
    return None


class Tracker:
    """What the last checkpoint holds for one name, to tell whether its value changed."""

    __slots__ = ("fingerprint", "quick", "ref", "ident", "seconds")

    def __init__(self, obj: Any, fingerprint: str, seconds: float) -> None:
        self.fingerprint = fingerprint
        self.quick = quick_key(obj)
        self.ident = id(obj)
        self.seconds = seconds
        try:
            self.ref: Callable[[], Any] | None = weakref.ref(obj)
        except TypeError:
            self.ref = None  # never hold a strong reference: `del x` must free memory (GPU!)

    def same_object(self, obj: Any) -> bool:
        if self.ref is not None:
            return self.ref() is obj
        return self.ident == id(obj)

    def unchanged_quickly(self, obj: Any, budget_seconds: float) -> bool:
        """True when the value certainly (quick key) or cheaply-presumably (identity of a value
        too costly to re-pickle every cell) did not change."""
        if self.quick is not None:
            if quick_key(obj) != self.quick:
                return False
            return type(obj) in _SCALARS or self.same_object(obj)
        return self.seconds > budget_seconds and self.same_object(obj)


# -- restoring ---------------------------------------------------------------------------------


def rebind_globals(value: Any, ns: MutableMapping[str, Any]) -> Any:
    """Functions and classes defined in the notebook come back bound to the kernel's namespace,
    as if their cell had been run again (dill gives them a private globals dict)."""
    if not isinstance(ns, dict):
        return value  # a function's globals must be a real dict
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        new = types.FunctionType(
            value.__code__, ns, value.__name__, value.__defaults__, value.__closure__
        )
        new.__kwdefaults__ = value.__kwdefaults__
        new.__dict__.update(value.__dict__)
        new.__qualname__ = value.__qualname__
        new.__annotations__ = value.__annotations__
        new.__doc__ = value.__doc__
        return new
    if isinstance(value, type) and value.__module__ == "__main__":
        for attr, member in list(vars(value).items()):
            if isinstance(member, types.FunctionType) and member.__module__ == "__main__":
                with contextlib.suppress(TypeError, AttributeError):
                    setattr(value, attr, rebind_globals(member, ns))
    return value


def import_modules(modules: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    values, errors = {}, {}
    for name, module in modules.items():
        try:
            values[name] = importlib.import_module(module)
        except Exception as e:  # a package uninstalled since: report, restore the rest
            errors[name] = f"import {module} failed: {type(e).__name__}: {e}"
    return values, errors
