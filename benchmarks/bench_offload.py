"""The NVMe store's read and write throughput against the disk's own sequential throughput.

In one run, on one directory:

* **disk**: one file of ``--size`` MB written sequentially in ``--chunk`` MB blocks from an
  aligned buffer, then fsync'ed; then read back the same way. ``O_DIRECT`` when the filesystem
  allows it (otherwise buffered, the written pages evicted with ``posix_fadvise(DONTNEED)``
  after the fsync so that the read comes from the disk, not the page cache);
* **store**: the same bytes as tensors of ``--tensor`` MB put into a
  :class:`funcpar.offload.NvmeStore` with ``fsync=True`` (so the bytes are on the disk when the
  time stops, as for the baseline) and flushed; then read back in order with read-ahead
  (``prefetch`` of the following tensors, as the offload transform does) into new tensors. The
  store's time includes everything a user pays: copying each tensor into a store buffer, the
  CRC-32, the header, the rename, and copying out of the buffer on a read.

Each measurement is repeated ``--reps`` times (disk and store alternating); the table gives
medians and the ratio store / disk (target >= 80 %).

    python benchmarks/bench_offload.py [--dir /tmp] [--size 512] [--tensor 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import tempfile
import time

import torch

from funcpar.offload import NvmeStore
from funcpar.offload.store import _probe_direct

MB = 1 << 20


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_sequential(directory: str, size: int, chunk: int, direct: bool) -> tuple[float, float]:
    """(write MB/s, read MB/s) of one large file, fsync'ed, O_DIRECT when ``direct``."""
    path = os.path.join(directory, "bench-seq.bin")
    buf = mmap.mmap(-1, chunk)  # page-aligned
    buf.write(os.urandom(chunk))
    view = memoryview(buf)
    flag = os.O_DIRECT if direct else 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
    try:
        for off in range(0, size, chunk):
            os.pwrite(fd, view, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    write = size / MB / (time.perf_counter() - t0)
    if not direct:
        _evict(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | flag)
    try:
        for off in range(0, size, chunk):
            os.preadv(fd, [view], off)
    finally:
        os.close(fd)
    read = size / MB / (time.perf_counter() - t0)
    view.release()
    buf.close()
    os.unlink(path)
    return write, read


def store_throughput(directory: str, size: int, tensor: int, workers: int, inflight: int,
                     o_direct: bool) -> tuple[float, float, str]:
    """(write MB/s, read MB/s, io mode) of NvmeStore over ``size`` bytes in tensors."""
    sub = tempfile.mkdtemp(prefix="store-", dir=directory)
    n = size // tensor
    xs = [torch.randint(0, 255, (tensor,), dtype=torch.uint8).view(torch.float32)
          for _ in range(min(n, 4))]  # reuse a few sources: memory stays small
    store = NvmeStore(sub, workers=workers, max_inflight=inflight, o_direct=o_direct, fsync=True)
    t0 = time.perf_counter()
    for i in range(n):
        store.put(f"t{i}", xs[i % len(xs)])
    store.flush()
    write = n * tensor / MB / (time.perf_counter() - t0)
    if not store.direct:
        for k in store.keys():
            _evict(store.path(k))
    t0 = time.perf_counter()
    ahead = 0
    for i in range(n):
        while ahead < n and store.prefetch(f"t{ahead}"):
            ahead += 1
        out = store.get(f"t{i}")
        ahead = max(ahead, i + 1)
        del out
    read = n * tensor / MB / (time.perf_counter() - t0)
    mode = store.io_mode
    for k in store.keys():
        store.delete(k)
    store.close()
    os.rmdir(sub)
    return write, read, mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    ap.add_argument("--size", type=int, default=512, help="MB per measurement")
    ap.add_argument("--tensor", type=int, default=32, help="MB per stored tensor")
    ap.add_argument("--chunk", type=int, default=8, help="MB per syscall of the baseline")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-direct", action="store_true", help="buffered I/O on both sides")
    args = ap.parse_args()
    size, tensor, chunk = args.size * MB, args.tensor * MB, args.chunk * MB
    if size % tensor or size % chunk:
        raise SystemExit("--size must be a multiple of --tensor and --chunk")
    direct = not args.no_direct and _probe_direct(args.dir)[0]
    disk_w, disk_r, st_w, st_r = [], [], [], []
    mode = ""
    for _ in range(args.reps):
        w, r = disk_sequential(args.dir, size, chunk, direct)
        disk_w.append(w)
        disk_r.append(r)
        w, r, mode = store_throughput(args.dir, size, tensor, args.workers, args.inflight,
                                      not args.no_direct)
        st_w.append(w)
        st_r.append(r)
    med = statistics.median
    fs = os.popen(f"df -T {args.dir} | tail -1").read().split()
    print(f"dir {args.dir} ({fs[1] if len(fs) > 1 else '?'} on {fs[0] if fs else '?'}) | "
          f"{platform.node()} {os.cpu_count()} cpus | {args.size} MB per run | "
          f"store: {args.tensor} MB tensors, {args.workers} workers, {args.inflight} buffers, "
          f"{mode}, fsync | disk: {args.chunk} MB blocks, "
          f"{'O_DIRECT' if direct else 'buffered + fadvise'}, fsync | {args.reps} reps, medians")
    print(f"{'':8}{'disk MB/s':>12}{'store MB/s':>12}{'store/disk':>12}   "
          f"(min-max disk; store)")
    for name, d, s in (("write", disk_w, st_w), ("read", disk_r, st_r)):
        print(f"{name:8}{med(d):12.0f}{med(s):12.0f}{med(s) / med(d):12.1%}   "
              f"({min(d):.0f}-{max(d):.0f}; {min(s):.0f}-{max(s):.0f})")


if __name__ == "__main__":
    main()
