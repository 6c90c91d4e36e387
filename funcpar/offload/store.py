"""Tensor stores: where offloaded tensors live between uses.

Two stores with one interface (``put`` / ``prefetch`` / ``get`` / ``flush`` / ``close``):

* :class:`CpuStore` keeps each tensor in host memory, page-locked (``pin_memory``) when CUDA is
  available so that host-to-device copies can be asynchronous. On a CPU-only build of torch
  there is no pinning and the tensors are plain host memory (``store.pinned`` says which).
* :class:`NvmeStore` keeps each tensor in its own file under a user-given directory, as
  DeepSpeed ZeRO-Infinity's swapper and Colossal-AI's NVMe offload do (Rajbhandari et al. 2021,
  arXiv 2104.07857). Reads ahead (``prefetch``) and writes behind (``put``) run on a small
  thread pool (the syscalls and the checksum release the GIL) through a fixed number of
  reusable, page-aligned (and pinned where CUDA allows) buffers, so the memory the store uses is
  bounded: at most ``max_inflight`` buffers, each as large as the largest tensor it carried
  (rounded up to 4 KiB), plus at most ``max_inflight - 1`` prefetched tensors waiting for
  their ``get``. The copies into the buffers run on the threads too; a tensor of 1 MiB or
  more is read straight into its own page-aligned memory (no copy out of a buffer). Files are
  opened with ``O_DIRECT`` where the filesystem accepts it,
  bypassing the page cache as the disk's own sequential throughput is measured; where it does
  not (tmpfs, some overlay filesystems) the store falls back to buffered I/O and says so in
  ``store.io_mode``.

**File format.** One file per key, ``<dir>/<key>.fpt``: a 4096-byte header (magic
``FUNCPAR-TENSOR-2``, then JSON: key, dtype, shape, byte count, the caller's integer ``tag``, the
checksum's name and value) followed by the tensor's bytes, padded to a multiple of 4096
(``O_DIRECT`` transfers whole blocks). The checksum runs over the data and then over the
header's key, dtype, shape, byte count, tag and algorithm, so an edited shape or dtype fails
as a flipped data byte does. A file is
written under a temporary name and renamed into place, so a crash mid-write leaves the previous
version of the key intact. Every read checks the magic, the size and the CRC-32 (zlib's, about
6 GB/s on one core here: cheap next to the disk) and raises :class:`StoreError` naming the key
and the path for a missing, truncated or corrupt file, or for a tag other than the expected
one. A full disk (``ENOSPC``) during a write-behind raises :class:`StoreError` at the next
``get``/``flush``/``check`` of the store, naming the key, the path and the bytes it needed.

**The directory.** Opening a store creates ``<dir>/.funcpar-store-rank<r>.lock`` holding the
process's pid and host (``r``: the distributed rank, 0 outside one; ranks of one run share a
directory, their keys carry the rank). A directory that cannot be created or written is a
:class:`StoreError` at open; a lock held by another live process on this host (or by any
process on another host, which cannot be checked) is refused naming its pid; a lock whose pid
is gone is taken over. Stores of one process share its lock (their ``prefix`` keeps their keys
apart); ``close`` of the last one removes it.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import mmap
import os
import re
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from funcpar.state.dir_lock import DirLock, LockHeld

__all__ = ["BLOCK", "CHECKSUMS", "CpuStore", "NvmeStore", "StoreError", "TensorStore",
           "aligned_empty"]

DIRECT_MIN = 1 << 20  # tensors from this size are read into their own memory, not a buffer
BLOCK = 4096  # header size and alignment of every transfer (O_DIRECT's logical block bound)
_MAGIC = b"FUNCPAR-TENSOR-2\n"  # /2: the checksum covers the header's fields too
_OLD_MAGIC = b"FUNCPAR-TENSOR-1\n"
#: The header fields the checksum covers (after the data): all that decide what a read returns.
_COVERED = ("key", "dtype", "shape", "nbytes", "tag", "checksum")
_LOCK = ".funcpar-store-{owner}.lock"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")

# Checksum name -> f(data, running value) -> value. CRC32C from the optional ``crc32c`` package
# (SSE4.2 / ARMv8 CRC instructions: ~17 GB/s on one core of this project's VM, against zlib's
# ~6.7 GB/s CRC-32, the fallback). Both release the GIL, so the worker threads overlap them.
CHECKSUMS: dict[str, Callable[[Any, int], int]] = {"crc32": zlib.crc32}
try:
    import crc32c as _crc32c

    CHECKSUMS["crc32c"] = lambda data, value=0: _crc32c.crc32c(data, value)
except ImportError:  # optional: funcpar[fast] installs it
    pass


class StoreError(RuntimeError):
    """A tensor could not be stored or read back: ``key`` and ``path`` say which."""

    def __init__(self, message: str, key: str, path: str | None = None) -> None:
        super().__init__(message)
        self.key, self.path = key, path


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key) or len(key) > 200:
        raise ValueError(f"a store key is 1-200 characters of [A-Za-z0-9._-] starting with a "
                         f"letter or digit, got {key!r}")
    return key


def _covered(header: dict) -> bytes:
    """The header's fields as the checksum covers them (canonical JSON), so that an edited
    shape, dtype, tag or key fails the check as a flipped data byte does."""
    return json.dumps([header[k] for k in _COVERED], separators=(",", ":")).encode()


def _owner() -> str:
    """The lock's owner name: the distributed rank (ranks of one run share a directory, their
    keys carry the rank), 0 outside a distributed run."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank{rank:05d}"


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _dtype_of(name: str, key: str, path: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise StoreError(f"tensor {key!r} in {path}: unknown dtype {name!r} in the header",
                         key, path)
    return dt


def _bytes_of(t: Tensor) -> Tensor:
    """The tensor's bytes as a flat uint8 tensor (on its device)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class TensorStore:
    """The interface of a store (see the module docstring).

    ``put(key, tensor, tag)`` may return before the data is durable (write-behind); the tensor
    must then stay unmodified until ``wait([key])`` or ``flush()``. ``prefetch(key, out=)``
    starts reading a key (a hint: it may decline when no buffer is free). ``get(key, tag,
    out=)`` returns a new CPU tensor with the stored contents, or fills ``out`` (a contiguous
    CPU tensor of the stored shape and dtype) and returns it; ``tag`` (when given) must equal
    the ``tag`` stored with it. ``flush()`` waits for every write and raises the first error.

    ``bytes_written`` / ``bytes_read`` count the tensor bytes given to ``put`` and returned by
    ``get`` (the payload: an NVMe file adds its 4 KiB header and the padding to whole blocks).
    """

    bytes_written = 0
    bytes_read = 0

    def put(self, key: str, tensor: Tensor, tag: int = 0) -> None:
        raise NotImplementedError

    def prefetch(self, key: str, out: Tensor | None = None) -> bool:
        return False

    def get(self, key: str, tag: int | None = None, out: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def wait(self, keys: Sequence[str]) -> None:
        """Wait for the writes of ``keys``: after it the store no longer reads the tensors
        given to their ``put``."""

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError

    def check(self) -> None:
        """Raise a write behind that has already failed (without waiting for the others)."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CpuStore(TensorStore):
    """Tensors in host memory: pinned when CUDA is available, plain memory otherwise."""

    def __init__(self, *, pin: bool | None = None) -> None:
        # Pinning needs a CUDA driver; on a CPU-only build pin_memory() raises, and there is
        # nothing to copy to asynchronously anyway.
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        if self.pinned and not torch.cuda.is_available():
            raise ValueError("CpuStore(pin=True) needs CUDA: pinned memory is page-locked for "
                             "DMA to a GPU, and this torch build has no CUDA device")
        self._data: dict[str, tuple[Tensor, int]] = {}

    def put(self, key: str, tensor: Tensor, tag: int = 0) -> None:
        _check_key(key)
        if not torch.is_tensor(tensor):
            raise TypeError(f"store key {key!r}: expected a tensor, got {type(tensor).__name__}")
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pinned)
        host.copy_(tensor.detach())
        self._data[key] = (host, int(tag))
        self.bytes_written += host.numel() * host.element_size()

    def get(self, key: str, tag: int | None = None, out: Tensor | None = None) -> Tensor:
        if key not in self._data:
            raise StoreError(f"tensor {key!r} is not in the CPU store", key)
        t, stored = self._data[key]
        if tag is not None and stored != tag:
            raise StoreError(f"tensor {key!r} in the CPU store has tag {stored}, expected {tag} "
                             "(a state older than the store's last two versions?)", key)
        self.bytes_read += t.numel() * t.element_size()
        if out is None:
            return t.clone()
        _check_out(out, {"shape": list(t.shape), "dtype": str(t.dtype)}, key, "the CPU store")
        return out.copy_(t)

    def delete(self, key: str) -> None:
        self._data.pop(key, None)

    def keys(self) -> list[str]:
        return sorted(self._data)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._data.values())


class _Buffer:
    """A reusable page-aligned host buffer (an anonymous mmap; pinned via cudaHostRegister
    when CUDA is available), grown when a larger request comes (up to ``BLOCK + request``)."""

    def __init__(self, pin: bool) -> None:
        self.pin, self.capacity = pin, 0
        self.mm: mmap.mmap | None = None
        self.tensor: Tensor | None = None
        self.pinned = False

    def ensure(self, n: int) -> None:
        if n <= self.capacity:
            return
        self.release()
        cap = max(_round_up(n), BLOCK)
        self.mm = mmap.mmap(-1, cap)  # page-aligned, as O_DIRECT requires
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.capacity = cap
        if self.pin:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), cap, 0)
            self.pinned = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0

    def release(self) -> None:
        if self.pinned and self.tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        # Dropped, not closed: the tensor view exports the mmap's buffer, and the memory goes
        # when the last reference does.
        self.pinned, self.tensor, self.mm, self.capacity = False, None, None, 0

    def view(self, n: int) -> memoryview:
        assert self.mm is not None
        return memoryview(self.mm)[:n]


def aligned_empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised host tensor whose memory is page-aligned and padded to whole 4 KiB
    blocks (an anonymous mmap), so :meth:`NvmeStore.get` with ``out=`` reads straight into it
    with ``O_DIRECT``, and :meth:`NvmeStore.put` writes straight from it (no copy through a
    store buffer). The memory lives as long as the tensor (and its views) do."""
    numel = 1
    for d in shape:
        numel *= int(d)
    n = numel * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    # Not MAP_POPULATE: an O_DIRECT read faults the pages in itself, inside the kernel, and
    # measured faster that way (reads into new tensors: 792 against 605 MB/s with
    # MAP_POPULATE, medians of 6 interleaved rounds on this project's loaded VM).
    mm = mmap.mmap(-1, _round_up(n))
    return torch.frombuffer(mm, dtype=torch.uint8)[:n].view(dtype).reshape(tuple(shape))


def _probe_direct(directory: str) -> tuple[bool, str]:
    """Whether files in ``directory`` can be written and read with O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return False, "buffered (this OS has no O_DIRECT)"
    probe = os.path.join(directory, f".odirect-probe-{os.getpid()}-{threading.get_ident()}")
    mm = mmap.mmap(-1, BLOCK)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, memoryview(mm), 0)
            os.preadv(fd, [memoryview(mm)], 0)
        finally:
            os.close(fd)
        return True, "O_DIRECT"
    except OSError as err:
        return False, f"buffered (O_DIRECT refused here: {os.strerror(err.errno or 0)})"
    finally:
        mm.close()
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


class NvmeStore(TensorStore):
    """Tensors in files under ``directory`` (see the module docstring).

    ``workers``: I/O threads. ``max_inflight``: the number of reusable buffers, hence the
    bound on the store's memory: at most ``max_inflight`` buffers of at most ``BLOCK +
    request_bytes`` each; a ``put`` waits for a free one, and at most ``max_inflight - 1``
    prefetched reads wait for their ``get``. ``request_bytes``: the size of each read or write
    syscall (a multiple of 4 KiB; 8 MiB measured best on this project's VM, where 32 MiB
    requests ran 20 % slower). ``o_direct``: try ``O_DIRECT`` (``io_mode`` says what was used).
    ``fsync``: make each write durable before its buffer is reused (off by default: a training
    state is rewritten every step and checkpoints are what must survive a crash; on for
    throughput measurements against a synced baseline). ``checksum``: ``"crc32c"`` (needs the
    ``crc32c`` package: hardware CRC32C, ~17 GB/s on one core here) or ``"crc32"`` (zlib,
    ~6.7 GB/s); ``None`` picks crc32c when it is installed. A file records its algorithm, and
    reading it needs that one.
    """

    def __init__(self, directory: str | os.PathLike, *, workers: int = 2, max_inflight: int = 4,
                 o_direct: bool = True, fsync: bool = False, pin: bool | None = None,
                 request_bytes: int = 8 << 20, checksum: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"NvmeStore needs workers >= 1, got {workers}")
        if max_inflight < 1:
            raise ValueError(f"NvmeStore needs max_inflight >= 1 buffers, got {max_inflight}")
        if request_bytes < BLOCK or request_bytes % BLOCK:
            raise ValueError(f"NvmeStore request_bytes must be a positive multiple of {BLOCK}, "
                             f"got {request_bytes}")
        if checksum is None:
            checksum = "crc32c" if "crc32c" in CHECKSUMS else "crc32"
        if checksum not in CHECKSUMS:
            raise ValueError(f"NvmeStore checksum {checksum!r} is not available here (have "
                             f"{sorted(CHECKSUMS)}; crc32c needs `pip install crc32c`)")
        self.checksum, self._crc = checksum, CHECKSUMS[checksum]
        self.directory = os.fspath(directory)
        self._closed = True  # until the lock is held: close() then releases nothing
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as err:
            raise StoreError(f"NvmeStore: cannot create the directory {self.directory}: "
                             f"{err}", "", self.directory) from err
        self.lock_path = os.path.abspath(os.path.join(self.directory,
                                                      _LOCK.format(owner=_owner())))
        self.direct, self.io_mode = (_probe_direct(self.directory) if o_direct
                                     else (False, "buffered (o_direct=False)"))
        self.fsync, self.max_inflight = bool(fsync), int(max_inflight)
        self.request = int(request_bytes)
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "funcpar-nvme")
        self._lock = threading.Condition()
        self._buffers = [_Buffer(self.pinned) for _ in range(self.max_inflight)]
        self._free = list(self._buffers)
        self._in_use = 0
        self.peak_in_use = 0  # the most buffers held at once (tests check the bound)
        self.zero_copy = 0  # transfers made straight from/to the caller's memory (tests)
        self._writes: dict[str, concurrent.futures.Future] = {}
        self._reads: dict[str, concurrent.futures.Future] = {}
        self._take_lock()  # last: a refused store holds nothing (close() has nothing to do)
        self._closed = False

    # -- the directory lock ---------------------------------------------------------------

    def _take_lock(self) -> None:
        """Own the directory (per rank; funcpar.state.dir_lock): two runs in one directory
        would read each other's state. Stores of this process share its lock (they tell
        their keys apart by ``prefix``, as offload applied twice in one test does). Creating
        the lock file is also the check that the directory is writable, so a read-only
        directory fails here, not at the first write-behind."""
        self._dir_lock = DirLock(self.lock_path)
        try:
            self._dir_lock.acquire()
        except LockHeld as held:
            raise StoreError(
                f"NvmeStore: {self.directory} is in use by process {held.pid} on {held.host} "
                f"(lock {self.lock_path}); one store directory per run. If that process is "
                "not a funcpar run, delete the lock file", "", self.lock_path) from None
        except OSError as err:
            raise StoreError(f"NvmeStore: cannot write in {self.directory} (creating "
                             f"{self.lock_path}: {err}); the store needs a writable "
                             "directory", "", self.directory) from err

    def _release_lock(self) -> None:
        self._dir_lock.release()

    # -- buffers --------------------------------------------------------------------------

    def _take(self) -> _Buffer:
        # Every holder gives its buffer back when its own I/O ends (a prefetched tensor waits
        # outside the buffers), so waiting here cannot deadlock.
        with self._lock:
            while not self._free:
                self._lock.wait()
            self._in_use += 1
            self.peak_in_use = max(self.peak_in_use, self._in_use)
            return self._free.pop()

    def _give(self, buf: _Buffer) -> None:
        with self._lock:
            self._free.append(buf)
            self._in_use -= 1
            self._lock.notify()

    def buffer_bytes(self) -> int:
        """Bytes held by the store's buffers (at most ``max_inflight * (BLOCK +
        request_bytes)``)."""
        return sum(b.capacity for b in self._buffers)

    def _count_zero_copy(self) -> None:
        with self._lock:
            self.zero_copy += 1

    def _direct_ok(self, t: Tensor, n: int) -> bool:
        """Whether ``n`` bytes at ``t``'s memory may be transferred without a store buffer."""
        return not self.direct or (t.data_ptr() % BLOCK == 0 and n % BLOCK == 0)

    # -- paths ----------------------------------------------------------------------------

    def path(self, key: str) -> str:
        return os.path.join(self.directory, _check_key(key) + ".fpt")

    def keys(self) -> list[str]:
        return sorted(f[:-4] for f in os.listdir(self.directory) if f.endswith(".fpt"))

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: str, tensor: Tensor, tag: int = 0) -> None:
        """Write ``tensor`` under ``key`` behind the caller: the copy into a store buffer, the
        checksum and the write run on the store's threads (in parallel with the caller and
        each other), so ``tensor`` must not be modified in place until the write is done
        (``flush``); funcpar's functional steps never modify a state tensor in place."""
        if self._closed:
            raise RuntimeError("the store is closed")
        path = self.path(key)
        if not torch.is_tensor(tensor):
            raise TypeError(f"store key {key!r}: expected a tensor, got {type(tensor).__name__}")
        self._wait_key(key)  # one operation per key at a time: the last put wins, in order
        data = _bytes_of(tensor.cpu() if tensor.device.type != "cpu" else tensor)
        header = {"key": key, "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                  "nbytes": data.numel(), "tag": int(tag), "checksum": self.checksum}
        buf = self._take()  # blocks while max_inflight buffers are busy: the memory bound
        fut = self._pool.submit(self._write, key, path, buf, header, data)
        with self._lock:
            self._writes[key] = fut
            self.bytes_written += data.numel()

    def _write(self, key: str, path: str, buf: _Buffer, header: dict, data: Tensor) -> None:
        """Write one file: the data in ``request``-sized pieces at offset ``BLOCK`` (each
        copied into the buffer, unless the source is page-aligned, and checksummed while it
        is in cache), then the header with the checksum at offset 0, then the rename."""
        tmp = f"{path}.tmp{threading.get_ident()}"
        n = header["nbytes"]
        try:
            # Whole blocks straight from a page-aligned source (no copy; any source with
            # buffered I/O, whose kernel copy is the page cache's); the rest through the buffer.
            direct = n if not self.direct else (
                n // BLOCK * BLOCK if self._direct_ok(data, 0) else 0)
            buf.ensure(BLOCK + min(self.request, _round_up(n - direct)))
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
            fd = os.open(tmp, flags, 0o600)
            try:
                src = data.numpy() if n else None
                crc, off = 0, 0
                if direct:
                    self._count_zero_copy()
                while off < direct:
                    m = min(self.request, direct - off)
                    piece = memoryview(src[off:off + m])
                    crc = self._crc(piece, crc)
                    _write_all(fd, piece, BLOCK + off)
                    off += m
                while off < n:
                    m = min(self.request, n - off)
                    buf.tensor[BLOCK:BLOCK + m].copy_(data[off:off + m])
                    padded = _round_up(m)
                    if padded > m:  # O_DIRECT writes whole blocks: zeros after the data
                        buf.tensor[BLOCK + m:BLOCK + padded].zero_()
                    body = buf.view(BLOCK + padded)
                    crc = self._crc(body[BLOCK:BLOCK + m], crc)
                    _write_all(fd, body[BLOCK:], BLOCK + off)
                    off += m
                del data, src
                if not self.direct and n % BLOCK:  # buffered: pad the file with zeros
                    os.ftruncate(fd, BLOCK + _round_up(n))
                header["crc"] = self._crc(_covered(header), crc)
                head = _MAGIC + json.dumps(header).encode() + b"\n"
                if len(head) > BLOCK:
                    raise StoreError(f"tensor {key!r}: header of {len(head)} bytes exceeds "
                                     f"{BLOCK} (shape {header['shape']} too long)", key, path)
                block = buf.view(BLOCK)
                block[:len(head)] = head
                block[len(head):] = bytes(BLOCK - len(head))
                _write_all(fd, block, 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as err:
            _unlink(tmp)
            if err.errno == errno.ENOSPC:
                failed = StoreError(f"disk full writing tensor {key!r} to {path}: it needs "
                                    f"{BLOCK + _round_up(n)} bytes "
                                    f"(free space under {self.directory} is exhausted)",
                                    key, path)
            else:
                failed = StoreError(f"writing tensor {key!r} to {path} failed: {err}", key,
                                    path)
            raise failed from err
        except BaseException:
            _unlink(tmp)
            raise
        finally:
            self._give(buf)

    def check(self) -> None:
        """Raise the error of a write behind that has already failed (naming its key and
        path), without waiting for the writes still running; each failure is raised once,
        here or by the ``get``/``flush`` that meets it. The offload transform calls it at the
        start and end of every update, so a write that fails fast (a read-only or full
        directory) is reported by the step that wrote it or the next one."""
        with self._lock:
            failed = next((k for k, f in self._writes.items()
                           if f.done() and f.exception() is not None), None)
            fut = None if failed is None else self._writes.pop(failed)
        if fut is not None:
            fut.result()

    def _wait_key(self, key: str) -> None:
        """Finish any operation on ``key``: a write (raising its error), a prefetch (dropped:
        its contents are about to be replaced)."""
        with self._lock:
            w, r = self._writes.pop(key, None), self._reads.pop(key, None)
        if w is not None:
            w.result()  # raises the write's error here, naming the key
        if r is not None:
            r.exception()  # its result (the old contents) is dropped

    def wait(self, keys: Sequence[str]) -> None:
        """Wait for the writes of ``keys`` (raising the first failure): after it the tensors
        given to those ``put`` calls are no longer read by the store."""
        for key in keys:
            with self._lock:
                w = self._writes.get(key)
            if w is not None:
                w.result()

    # -- reads ----------------------------------------------------------------------------

    def prefetch(self, key: str, out: Tensor | None = None) -> bool:
        """Start reading ``key`` in the background (into ``out`` when given, see ``get``);
        False when ``max_inflight - 1`` reads are already waiting for their ``get`` (a hint:
        the ``get`` then reads it itself). Several reads in flight matter on a disk where each
        file's first request waits (measured on this project's VM: 16 files of 32 MB read at
        82 % of one large file's rate by one thread, 99 % by two)."""
        with self._lock:
            if key in self._reads:
                return True
            w = self._writes.get(key)
            if w is not None and not w.done():
                return False  # read after the write lands; the get will do it
            if len(self._reads) >= max(self.max_inflight - 1, 0):
                return False
            self._reads[key] = self._pool.submit(self._read, key, self.path(key), out)
        return True

    def get(self, key: str, tag: int | None = None, out: Tensor | None = None) -> Tensor:
        """The stored tensor (a new one, or ``out`` filled: a contiguous CPU tensor of the
        stored shape and dtype; page-aligned, as :func:`aligned_empty` makes, it is read into
        with ``O_DIRECT`` and no copy)."""
        path = self.path(key)
        with self._lock:
            fut = self._reads.pop(key, None)
            w = self._writes.pop(key, None)
        if w is not None:
            w.result()
        if fut is not None:
            header, got = fut.result()
            if out is not None and got is not out:  # prefetched elsewhere: one copy
                _check_out(out, header, key, path)
                out.copy_(got)
                got = out
        else:
            header, got = self._read(key, path, out)
        if tag is not None and header["tag"] != tag:
            raise StoreError(f"tensor {key!r} in {path} has tag {header['tag']}, expected "
                             f"{tag} (a state older than the store's last two versions?)",
                             key, path)
        self.bytes_read += got.numel() * got.element_size()
        return got

    def _read(self, key: str, path: str, out: Tensor | None) -> tuple[dict, Tensor]:
        """Read ``key`` and verify it (on the calling thread: a worker for a prefetch).

        The data go straight into their destination where it is page-aligned (``out`` from
        :func:`aligned_empty`; a new tensor of >= ``DIRECT_MIN`` bytes, made page-aligned for
        it), in ``request``-sized pieces each checksummed as it lands; otherwise (small
        tensors, an unaligned ``out``, the last partial block) through a store buffer and a
        copy."""
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            raise StoreError(f"tensor {key!r}: its file {path} is missing", key, path) from None
        buf = None
        try:
            size = os.fstat(fd).st_size
            if size < BLOCK or size % BLOCK:
                raise StoreError(f"tensor {key!r}: file {path} is truncated or corrupt "
                                 f"({size} bytes, not a whole number of {BLOCK}-byte blocks)",
                                 key, path)
            head_mm = mmap.mmap(-1, BLOCK)
            _fill(fd, memoryview(head_mm), 0, key, path)
            header = self._header(key, path, memoryview(head_mm))
            n = header["nbytes"]
            if BLOCK + _round_up(n) != size:
                raise StoreError(f"tensor {key!r}: file {path} has {size} bytes, its header "
                                 f"says {BLOCK + _round_up(n)}: truncated or corrupt", key, path)
            crc_fn = CHECKSUMS.get(header["checksum"])
            if crc_fn is None:
                raise StoreError(f"tensor {key!r}: file {path} was checksummed with "
                                 f"{header['checksum']!r}, not available here (install the "
                                 "crc32c package)", key, path)
            dtype = _dtype_of(header["dtype"], key, path)
            if out is not None:
                _check_out(out, header, key, path)
                dest = _bytes_of(out)
            elif n >= DIRECT_MIN:  # its own page-aligned memory, padded to whole blocks
                dest = aligned_empty((_round_up(n),), torch.uint8)
            else:
                dest = torch.empty(n, dtype=torch.uint8)
            view = dest.numpy() if n else None
            # The prefix of whole blocks that can be read without a buffer.
            direct = n if not self.direct else (
                min(dest.numel(), _round_up(n)) // BLOCK * BLOCK
                if self._direct_ok(dest, 0) else 0)
            if direct:
                self._count_zero_copy()
            crc, off = 0, 0
            while off < min(direct, n):
                m = min(self.request, direct - off)
                _fill(fd, memoryview(view[off:off + m]), BLOCK + off, key, path)
                crc = crc_fn(memoryview(view[off:min(off + m, n)]), crc)
                off += m
            if off < n:
                buf = self._take()
                buf.ensure(min(self.request, _round_up(n - off)))
                while off < n:
                    m = min(self.request, n - off)
                    piece = buf.view(_round_up(m))
                    _fill(fd, piece, BLOCK + off, key, path)
                    crc = crc_fn(piece[:m], crc)
                    dest[off:off + m].copy_(buf.tensor[:m])
                    off += m
        finally:
            os.close(fd)
            if buf is not None:
                self._give(buf)
        crc = crc_fn(_covered(header), crc)
        if crc != header["crc"]:
            raise StoreError(f"tensor {key!r}: file {path} is corrupt ({header['checksum']} "
                             f"{crc:#010x}, header says {header['crc']:#010x}; the checksum "
                             "covers the data and the header's key, dtype, shape, size and "
                             "tag)", key, path)
        if out is not None:
            return header, out
        return header, dest[:n].view(dtype).reshape(header["shape"])

    @staticmethod
    def _header(key: str, path: str, block: memoryview) -> dict:
        raw = bytes(block)
        if raw.startswith(_OLD_MAGIC):
            raise StoreError(f"tensor {key!r}: file {path} is of format 1 (an older funcpar, "
                             "whose checksum did not cover the header): not read; the store "
                             "is a run's scratch space, start it in a fresh directory", key,
                             path)
        if not raw.startswith(_MAGIC):
            raise StoreError(f"tensor {key!r}: file {path} is corrupt (bad magic: not a "
                             "funcpar tensor file)", key, path)
        line = raw[len(_MAGIC):].split(b"\n", 1)[0]
        try:
            header = json.loads(line)
            _ = (header["dtype"], header["shape"], int(header["nbytes"]), int(header["crc"]),
                 int(header["tag"]), str(header["checksum"]), _covered(header))
        except (ValueError, KeyError, TypeError) as err:
            raise StoreError(f"tensor {key!r}: file {path} has a corrupt header ({err})", key,
                             path) from None
        if header.get("key") != key:
            raise StoreError(f"tensor {key!r}: file {path} holds tensor {header.get('key')!r}",
                             key, path)
        return header

    # -- housekeeping ---------------------------------------------------------------------

    def delete(self, key: str) -> None:
        self._wait_key(key)
        _unlink(self.path(key))

    def flush(self) -> None:
        """Wait for every write behind; raise the first failure (naming key and path)."""
        with self._lock:
            writes = list(self._writes.items())
            self._writes.clear()
        first: BaseException | None = None
        for _, fut in writes:
            err = fut.exception()
            if err is not None and first is None:
                first = err
        if first is not None:
            raise first

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._release_lock()
            with self._lock:
                reads = list(self._reads.values())
                self._reads.clear()
            for fut in reads:  # finish the reads nobody took
                fut.exception()
            self._pool.shutdown(wait=True)
            for b in self._buffers:
                b.release()
            self._closed = True

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __del__(self) -> None:
        if getattr(self, "_closed", True):  # closed, or its __init__ refused it
            return
        try:
            self.close()
        except StoreError as err:  # never lost: a failed write-behind nobody flushed
            warnings.warn(f"NvmeStore({self.directory!r}) dropped without close(): {err}",
                          RuntimeWarning, stacklevel=1)
        except Exception:  # interpreter shutdown: builtins may be gone
            pass


def _check_out(out: Tensor, header: dict, key: str, path: str) -> None:
    want = (tuple(header["shape"]), header["dtype"])
    if not torch.is_tensor(out) or (tuple(out.shape), str(out.dtype)) != want:
        got = (tuple(out.shape), str(out.dtype)) if torch.is_tensor(out) else type(out).__name__
        raise ValueError(f"get({key!r}, out=): the file {path} holds {want[0]} {want[1]}, out "
                         f"is {got}")
    if out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"get({key!r}, out=): out must be a contiguous CPU tensor, got one on "
                         f"{out.device} (contiguous: {out.is_contiguous()})")


def _fill(fd: int, view: memoryview, offset: int, key: str, path: str) -> None:
    """Read ``len(view)`` bytes at ``offset`` (``preadv`` may return fewer than asked)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise StoreError(f"tensor {key!r}: file {path} ended early", key, path)
        done += got


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):  # pwrite may write less than asked
        done += os.pwrite(fd, view[done:], offset + done)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
