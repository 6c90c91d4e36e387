"""Peak heap memory of a CPU process, for checking the cost model's memory per rank.

CPU tensors come from glibc's ``malloc`` (large ones by ``mmap``): glibc's ``mallinfo2()``
reports the bytes in use, ``uordblks`` (arena chunks) + ``hblkhd`` (mmapped chunks). torch keeps
no CPU allocator statistics, so :class:`HeapPeak` samples that sum in a thread (every 0.2 ms;
torch's ops release the GIL) and gives the largest rise over its value when the block began:
what a training step allocates beyond the state it was given. Linux with glibc only
(:func:`available`); a peak shorter than the sampling period can be missed, so the value is a
lower bound.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["HeapPeak", "available", "heap_in_use"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                                               "hblkhd", "usmblks", "fsmblks", "uordblks",
                                               "fordblks", "keepcost")]


def heap_in_use() -> Callable[[], int]:
    """A function returning glibc's bytes in use (OSError/AttributeError without glibc)."""
    libc = ctypes.CDLL("libc.so.6")
    fn = libc.mallinfo2
    fn.restype = _MallInfo2

    def read() -> int:
        m = fn()
        return m.uordblks + m.hblkhd

    return read


def available() -> bool:
    try:
        heap_in_use()()
    except (OSError, AttributeError):
        return False
    return True


class HeapPeak:
    """``with HeapPeak() as p: ...`` then ``p.rise``: the largest bytes in use above the value
    at entry (module docstring)."""

    def __init__(self, period: float = 0.0002) -> None:
        self.period = period
        self.rise = 0
        self._read = heap_in_use()

    def __enter__(self) -> HeapPeak:
        self._base = self._read()
        self._peak = self._base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._read())
            time.sleep(self.period)

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._read())
        self.rise = self._peak - self._base
