"""The NVMe store's read and write throughput against the disk's own sequential throughput.

In one run, on one directory, interleaved round by round (the order flipped every other
round, so the drift of a shared disk falls on both sides alike):

* **disk**: one file of ``--size`` MB written sequentially in ``--chunk`` MB blocks from an
  aligned buffer, then fsync'ed; then read back the same way. ``O_DIRECT`` when the filesystem
  allows it (otherwise buffered, the written pages evicted with ``posix_fadvise(DONTNEED)``
  after the fsync so that the read comes from the disk, not the page cache);
* **store**: the same bytes as tensors of ``--tensor`` MB (plain torch tensors, not
  page-aligned, as an optimizer's outputs are) put into a :class:`funcpar.offload.NvmeStore`
  with ``fsync=True`` (so the bytes are on the disk when the time stops, as for the baseline)
  and flushed; then read back in order, (``read``) into new tensors with read-ahead
  (``prefetch`` of the following tensors, as the offload transform does), and (``read into``)
  into ``--inflight`` reused page-aligned tensors with ``prefetch(out=)`` / ``get(out=)``
  (O_DIRECT straight into them, read ahead as far). The store's time includes everything a
  user pays: the copy into a store buffer, the checksum (CRC32C with the ``crc32c`` package,
  else zlib's CRC-32), the header, the rename, the new tensors' memory.

The table gives the median throughputs and the median of the per-round ratios store / disk
(target >= 80 %). Row ``read/fresh`` compares the store's reads into new tensors with the disk
read into new memory of the file's size (fresh pages the kernel must fault in and zero, as
new tensors are), the like-for-like baseline of that path.

    python benchmarks/bench_offload.py [--dir /tmp] [--size 512] [--tensor 32] [--rounds 7]
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

from funcpar.offload import CHECKSUMS, NvmeStore, aligned_empty
from funcpar.offload.store import _probe_direct

MB = 1 << 20


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class DiskBench:
    """The baseline: one file of ``size`` bytes in ``chunk``-byte syscalls from one aligned
    buffer, fsync'ed; read back the same way."""

    def __init__(self, directory: str, size: int, chunk: int, direct: bool) -> None:
        self.path = os.path.join(directory, f"bench-seq-{os.getpid()}.bin")
        self.size, self.chunk, self.direct = size, chunk, direct
        self.buf = mmap.mmap(-1, chunk)  # page-aligned
        self.buf.write(os.urandom(chunk))

    def write(self) -> float:
        view = memoryview(self.buf)
        t0 = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                     (os.O_DIRECT if self.direct else 0), 0o600)
        try:
            for off in range(0, self.size, self.chunk):
                os.pwrite(fd, view, off)
            os.fsync(fd)
        finally:
            os.close(fd)
        mbs = self.size / MB / (time.perf_counter() - t0)
        if not self.direct:
            _evict(self.path)
        return mbs

    def read(self, fresh: bool = False) -> float:
        """Into the one reused buffer, or (``fresh``) into new memory of the file's size, as a
        read into new tensors lands: the kernel then faults in and zeroes every page."""
        t0 = time.perf_counter()
        dest = mmap.mmap(-1, self.size) if fresh else None
        view = memoryview(dest if fresh else self.buf)
        fd = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            for off in range(0, self.size, self.chunk):
                os.preadv(fd, [view[off:off + self.chunk] if fresh else view], off)
        finally:
            os.close(fd)
        mbs = self.size / MB / (time.perf_counter() - t0)
        view.release()
        if dest is not None:
            dest.close()
        return mbs

    def close(self) -> None:
        os.unlink(self.path)
        self.buf.close()


class StoreBench:
    """The store's side: ``size`` bytes as tensors of ``tensor`` bytes in ``NvmeStore``."""

    def __init__(self, directory: str, size: int, tensor: int, workers: int, inflight: int,
                 o_direct: bool, request: int, checksum: str | None) -> None:
        self.sub = tempfile.mkdtemp(prefix="store-", dir=directory)
        self.n = size // tensor
        # A few sources reused: memory stays small. Plain torch tensors (not page-aligned),
        # as an optimizer's outputs are, so every put copies through a store buffer.
        self.xs = [torch.randint(0, 255, (tensor,), dtype=torch.uint8).view(torch.float32)
                   for _ in range(min(self.n, 4))]
        # Reused page-aligned destinations for the zero-copy read (get(out=)).
        self.outs = [aligned_empty((tensor // 4,), torch.float32) for _ in range(inflight)]
        self.store = NvmeStore(self.sub, workers=workers, max_inflight=inflight,
                               o_direct=o_direct, fsync=True, request_bytes=request,
                               checksum=checksum)
        self.bytes = self.n * tensor

    def write(self) -> float:
        t0 = time.perf_counter()
        for i in range(self.n):
            self.store.put(f"t{i}", self.xs[i % len(self.xs)])
        self.store.flush()
        if not self.store.direct:
            for k in self.store.keys():
                _evict(self.store.path(k))
        return self.bytes / MB / (time.perf_counter() - t0)

    def read(self, into: bool) -> float:
        """Read back in order: into new tensors with read-ahead (``prefetch`` of the following
        tensors, as the offload transform does), or ``into`` reused page-aligned tensors
        (``get(out=)``: O_DIRECT straight into them)."""
        n, store = self.n, self.store
        t0 = time.perf_counter()
        ahead = 0
        outs = self.outs
        for i in range(n):
            # Read ahead as far as the store allows (into the destination that tensor will
            # land in, for ``into``: each of the reused destinations is taken by one read).
            while ahead < n and (not into or ahead < i + len(outs)) and store.prefetch(
                    f"t{ahead}", out=outs[ahead % len(outs)] if into else None):
                ahead += 1
            out = store.get(f"t{i}", out=outs[i % len(outs)] if into else None)
            ahead = max(ahead, i + 1)
            del out
        return self.bytes / MB / (time.perf_counter() - t0)

    def close(self) -> str:
        mode = self.store.io_mode
        for k in self.store.keys():
            self.store.delete(k)
        self.store.close()
        os.rmdir(self.sub)
        return mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    ap.add_argument("--size", type=int, default=512, help="MB per measurement")
    ap.add_argument("--tensor", type=int, default=32, help="MB per stored tensor")
    ap.add_argument("--chunk", type=int, default=8, help="MB per syscall of the baseline")
    ap.add_argument("--request", type=int, default=8, help="MB per syscall of the store")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--checksum", default=None, choices=sorted(CHECKSUMS),
                    help="default: crc32c when installed, else crc32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-direct", action="store_true", help="buffered I/O on both sides")
    args = ap.parse_args()
    size, tensor, chunk = args.size * MB, args.tensor * MB, args.chunk * MB
    if size % tensor or size % chunk:
        raise SystemExit("--size must be a multiple of --tensor and --chunk")
    direct = not args.no_direct and _probe_direct(args.dir)[0]
    disk = DiskBench(args.dir, size, chunk, direct)
    bench = StoreBench(args.dir, size, tensor, args.workers, args.inflight, not args.no_direct,
                       args.request * MB, args.checksum)
    rows: dict[str, list[tuple[float, float]]] = {"write": [], "read": [], "read into": [],
                                                  "read/fresh": []}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        # Interleaved, the order flipped every other round, so that the disk's drift (a
        # shared virtual disk, other processes) falls on both sides alike; each round's ratio
        # pairs measurements taken a second apart.
        if r % 2 == 0:
            dw, sw = disk.write(), bench.write()
            dr, df, sr, si = disk.read(), disk.read(True), bench.read(False), bench.read(True)
        else:
            sw, dw = bench.write(), disk.write()
            sr, si, df, dr = bench.read(False), bench.read(True), disk.read(True), disk.read()
        rows["write"].append((dw, sw))
        rows["read"].append((dr, sr))
        rows["read into"].append((dr, si))
        rows["read/fresh"].append((df, sr))
    load = max(load, os.getloadavg()[0])
    mode = bench.close()
    disk.close()
    med = statistics.median
    fs = os.popen(f"df -T {args.dir} | tail -1").read().split()
    print(f"dir {args.dir} ({fs[1] if len(fs) > 1 else '?'} on {fs[0] if fs else '?'}) | "
          f"{platform.node()} {os.cpu_count()} cpus, load {load:.1f} | {args.size} MB per run | "
          f"store: {args.tensor} MB tensors, {args.request} MB requests, {args.workers} workers, "
          f"{args.inflight} buffers, {mode}, {bench.store.checksum}, fsync | disk: {args.chunk} "
          f"MB blocks, {'O_DIRECT' if direct else 'buffered + fadvise'}, fsync | "
          f"{args.rounds} interleaved rounds, medians")
    print(f"{'':10}{'disk MB/s':>10}{'store MB/s':>11}{'ratio':>8}   (per-round ratios min-max; "
          f"disk min-max)")
    for name, pairs in rows.items():
        d, s = [p[0] for p in pairs], [p[1] for p in pairs]
        ratios = [b / a for a, b in pairs]
        print(f"{name:10}{med(d):10.0f}{med(s):11.0f}{med(ratios):8.1%}   "
              f"({min(ratios):.0%}-{max(ratios):.0%}; {min(d):.0f}-{max(d):.0f})")


if __name__ == "__main__":
    main()
