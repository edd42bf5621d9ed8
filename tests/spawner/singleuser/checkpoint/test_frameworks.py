"""Fast paths for framework data: pandas frames (numpy blocks out of band) and torch tensors
(host copies, device recorded, restored to that device when it exists). Set-up installs both
(torch pinned, from PyPI): a missing one fails here rather than skipping."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from gpulab.spawner.singleuser.checkpoint import namespace
from gpulab.spawner.singleuser.checkpoint.saver import NamespaceCheckpointer


def _restore(store) -> tuple[dict, object]:
    ns: dict = {}
    report = NamespaceCheckpointer(store).restore(ns)
    return ns, report


def test_pandas_frames_round_trip_with_their_columns_written_raw(store):
    n = 200_000
    df = pd.DataFrame(
        {
            "x": np.arange(n, dtype=np.float64),
            "k": np.arange(n) % 7,
            "name": [f"r{i % 10}" for i in range(n)],
        }
    )
    NamespaceCheckpointer(store).save({"df": df}, exact=True)
    entry = store.read_manifest().variables["df"]
    assert entry.engine == "pickle"
    assert df["x"].to_numpy().tobytes() in (store.blobs / entry.blob).read_bytes()
    ns, _ = _restore(store)
    pd.testing.assert_frame_equal(ns["df"], df)


def test_torch_tensors_modules_and_parameters_round_trip(store):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ns = {
        "t": torch.randn(3, 5),
        "half": torch.randn(4, 4).to(torch.bfloat16),
        "grad": torch.ones(2, requires_grad=True),
        "model": model,
        "batch": {"ids": torch.arange(10), "mask": torch.ones(10, dtype=torch.bool)},
        "scalar": torch.tensor(3.5),
    }
    NamespaceCheckpointer(store).save(ns, exact=True)
    out, report = _restore(store)
    assert not report.failed
    for k in ("t", "half", "scalar"):
        assert out[k].dtype == ns[k].dtype and torch.equal(out[k], ns[k]), k
    assert out["grad"].requires_grad and out["grad"].device.type == "cpu"
    assert torch.equal(out["batch"]["mask"], ns["batch"]["mask"])
    x = torch.randn(5, 8)
    assert torch.equal(out["model"](x), model(x))
    assert isinstance(out["model"][0].weight, torch.nn.Parameter)


def test_torch_in_place_updates_are_seen_through_the_version_counter(store):
    cp = NamespaceCheckpointer(store)
    ns = {"w": torch.zeros(1_000_000)}
    cp.save(ns)
    assert cp.save(ns).skipped == "nothing changed"  # unchanged version: not even re-pickled
    ns["w"][123] = 1.0  # a sparse in-place edit bumps _version
    assert cp.save(ns).written == ["w"]


def test_tensor_saved_on_a_missing_device_comes_back_on_the_cpu_and_says_so():
    namespace.DEVICE_FALLBACKS.clear()
    raw = torch.arange(4, dtype=torch.float32).view(torch.uint8).numpy().copy()
    t = namespace._rebuild_tensor(raw, "float32", (4,), "cuda:7", False, False)
    assert t.device.type == "cpu" and t.tolist() == [0.0, 1.0, 2.0, 3.0]
    if not torch.cuda.is_available():
        assert namespace.DEVICE_FALLBACKS == {"cuda:7": "cpu"}
