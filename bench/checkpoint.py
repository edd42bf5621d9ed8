"""Kernel-checkpoint save and restore speed beside the raw speed of the same disk, in the same run.

    .venv/bin/python -m bench.checkpoint [--quick] [--dir PATH] [--repeats N]

For namespaces of numpy arrays (10 MB, 100 MB, and 1 GB without --quick) and of 100k small Python
objects, it measures:

- raw write: the same number of bytes written sequentially (8 MiB writes) to a new file, then
  fsync: what the disk can do;
- save: a full, exact checkpoint into an empty store (`NamespaceCheckpointer.save(exact=True)`:
  pickling, HMAC-SHA256 signing, a fsync per blob, the directory and the manifest);
- raw read / restore: after `posix_fadvise(POSIX_FADV_DONTNEED)` on every file (fsynced, so their
  pages are clean and the kernel drops them: reads come from the disk, not the page cache; no need
  for a global drop_caches), a sequential read of the raw file into freshly allocated memory (as
  any loader must) vs a full restore (read, verify every signature, unpickle).

Memory the run will use is touched once before measuring (see `warm_memory`).

"idle cell check" is the per-cell save that follows when nothing changed (no write): what every
idle cell costs. Each case alternates raw and checkpoint runs `--repeats` times and reports medians. The last line
compares the largest array namespace: save MB/s / raw write MB/s, restore MB/s / raw read MB/s,
and checkpoint bytes on disk / array bytes. Goal: save >= 0.5 x raw write, size <= 1.1 x data.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpulab.spawner.singleuser.checkpoint import derive_user_key
from gpulab.spawner.singleuser.checkpoint.saver import NamespaceCheckpointer
from gpulab.spawner.singleuser.checkpoint.store import CheckpointStore

MB = 1_000_000
CHUNK = 8 << 20
KEY = derive_user_key(b"bench-hub-secret-0123456789", "bench")


def _drop_cache(path: Path) -> None:
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: Path, data: memoryview) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off in range(0, data.nbytes, CHUNK):
            view = data[off : off + CHUNK]
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_read(path: Path, nbytes: int) -> float:
    """Into freshly allocated memory, as any loader (and a restore) must."""
    _drop_cache(path)
    start = time.perf_counter()
    into = memoryview(np.empty(nbytes, dtype=np.uint8))
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < into.nbytes:
            n = f.readinto(into[off : off + CHUNK])
            if not n:
                break
            off += n
    return time.perf_counter() - start


def ckpt_save(store_dir: Path, ns: dict[str, Any]) -> tuple[float, int, float]:
    """Seconds for a full save, bytes on disk, and seconds of the per-cell check that follows
    when nothing changed (what every idle cell costs)."""
    store = CheckpointStore(store_dir, KEY, "bench")
    cp = NamespaceCheckpointer(store)
    start = time.perf_counter()
    report = cp.save(ns, exact=True)
    seconds = time.perf_counter() - start
    assert report.committed and not report.unpicklable, report.summary()
    size = sum(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
    start = time.perf_counter()
    idle = cp.save(ns)
    idle_seconds = time.perf_counter() - start
    assert not idle.committed and idle.skipped == "nothing changed", idle.summary()
    return seconds, size, idle_seconds


def ckpt_restore(store_dir: Path, expect: int) -> float:
    _drop_cache(store_dir)
    store = CheckpointStore(store_dir, KEY, "bench")
    ns: dict[str, Any] = {}
    start = time.perf_counter()
    report = NamespaceCheckpointer(store).restore(ns)
    seconds = time.perf_counter() - start
    assert len(report.restored) == expect and not report.failed, report.summary()
    return seconds


@dataclass
class Row:
    case: str
    data_bytes: int
    raw_write: float
    save: float
    raw_read: float
    restore: float
    size_ratio: float
    idle_check: float

    def mbps(self, seconds: float) -> float:
        return self.data_bytes / MB / seconds


def arrays(total: int, count: int = 8) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    per = total // count // 4
    return {f"a{i}": rng.standard_normal(per, dtype=np.float32) for i in range(count)}


def small_objects(n: int = 100_000) -> dict[str, Any]:
    return {
        "records": [
            {"id": i, "name": f"item-{i}", "score": i * 0.5, "tags": ("x", i % 7)} for i in range(n)
        ]
    }


def measure(
    case: str, ns: dict[str, Any], data_bytes: int, raw_source: memoryview, work: Path, repeats: int
) -> Row:
    w, s, r, rs, sizes, idle = [], [], [], [], [], []
    for i in range(repeats):
        raw = work / f"raw-{i}.bin"
        store = work / f"store-{i}"
        w.append(raw_write(raw, raw_source))
        sec, size, idle_sec = ckpt_save(store, ns)
        s.append(sec)
        sizes.append(size)
        idle.append(idle_sec)
        r.append(raw_read(raw, raw_source.nbytes))
        rs.append(ckpt_restore(store, len(ns)))
        raw.unlink()
        shutil.rmtree(store)
    return Row(
        case,
        data_bytes,
        statistics.median(w),
        statistics.median(s),
        statistics.median(r),
        statistics.median(rs),
        statistics.median(sizes) / data_bytes,
        statistics.median(idle),
    )


def warm_memory(nbytes: int) -> float:
    """Touch (then free) as much memory as the run will use. In a VM whose memory the host maps
    lazily (Firecracker, some clouds) the first touch of a page costs ~3 s/GB, once; without
    this, whichever measurement first touches fresh memory pays it (the guest reuses the pages
    afterwards)."""
    start = time.perf_counter()
    step = 256 * MB
    blocks = [np.ones(step, dtype=np.uint8) for _ in range(max(1, nbytes // step))]
    del blocks
    return time.perf_counter() - start


def _filesystem(path: Path) -> str:
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    return f"{best[1]} ({best[2]}) mounted on {best[0]}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 MB and 100 MB only (under a minute)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in $TMPDIR)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per case (median reported)")
    args = ap.parse_args(argv)
    sizes = [10 * MB, 100 * MB] if args.quick else [10 * MB, 100 * MB, 1000 * MB]
    repeats = args.repeats or (3 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="gpulab-bench-ckpt-", dir=args.dir))
    print(f"disk: {_filesystem(work.resolve())}; {os.cpu_count()} CPUs; repeats={repeats} (median)")
    warm = warm_memory(5 * max(sizes))
    print(f"memory warm-up: {5 * max(sizes) / MB:,.0f} MB touched in {warm:.1f} s")
    rows: list[Row] = []
    try:
        for size in sizes:
            ns = arrays(size)
            nbytes = sum(a.nbytes for a in ns.values())
            source = memoryview(np.concatenate([a.view(np.uint8) for a in ns.values()]))
            rows.append(measure(f"numpy {size // MB} MB", ns, nbytes, source, work, repeats))
            del ns, source
        ns = small_objects()
        blob = pickle.dumps(ns["records"], protocol=5)
        rows.append(
            measure(
                "100k small objects", ns, len(blob), memoryview(blob), work, max(1, repeats - 1)
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print(rows)


def _print(rows: list[Row]) -> None:
    head = (
        "| namespace | data | raw write MB/s | save MB/s | save/raw | raw read MB/s "
        "| restore MB/s | restore/raw | size/data | idle cell check |"
    )
    print(head)
    print("|---" * 10 + "|")
    fmt: Callable[[float], str] = lambda x: f"{x:,.0f}"  # noqa: E731
    for r in rows:
        print(
            f"| {r.case} | {r.data_bytes / MB:,.0f} MB | {fmt(r.mbps(r.raw_write))} | {fmt(r.mbps(r.save))} "
            f"| {r.raw_write / r.save:.2f} | {fmt(r.mbps(r.raw_read))} | {fmt(r.mbps(r.restore))} "
            f"| {r.raw_read / r.restore:.2f} | {r.size_ratio:.3f} | {r.idle_check * 1000:.1f} ms |"
        )
    largest = max((r for r in rows if r.case.startswith("numpy")), key=lambda r: r.data_bytes)
    print(
        f"save_vs_disk={largest.raw_write / largest.save:.2f} "
        f"restore_vs_disk={largest.raw_read / largest.restore:.2f} size_ratio={largest.size_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
