"""Shared pieces of the multi-tensor Triton kernels: tables, scalars, output allocation.

One launch updates many leaves. The leaves of a call are grouped by device and dtypes (the
dtypes are compile-time constants of a kernel); for each group two small tables go to the
kernel:

* a *leaf table* (int64, one row per leaf): the leaf's element count, its flags (say whether
  weight decay applies) and the raw addresses of its input and output tensors. The kernel
  casts an address back to a typed pointer (``int64 -> pointer``), so any number of leaves of
  any sizes share one launch without copying them into one buffer. The addresses change every
  step (the outputs are new tensors: steps are pure), so this table is rebuilt per call: a few
  dozen bytes per leaf, copied to the device asynchronously.
* a *tile table* (int32, one row per program): ``(leaf, tile)``, the leaf that program ``i``
  works on and which ``BLOCK``-sized tile of it. It depends only on the leaf sizes, so it is
  cached per (sizes, block, device) and stays on the device.

Hyperparameters arrive as 0-d float64 tensors (schedules, :mod:`funcpar.optim.hyperparams`);
:func:`device_scalars` rounds them to float32 (the rounding the plain-torch reference applies
when it multiplies a float32 tensor by them) and moves them with ``non_blocking=True``, so a
step never waits for the host to read a value back from the device.

The host side of a launch is the same for every kernel: :func:`group_by` splits the leaves
into launch groups, a :class:`LeafGroup` collects a group's rows (skipping empty leaves) and
launches the kernel over its tiles, and :func:`kernels_apply` is the dispatch test.

Triton is imported lazily: :func:`lazy_kernels` builds a module's kernels on first use (once
per interpreter/compiled mode), so ``import funcpar`` works without Triton.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, no_type_check

import torch
from torch import Tensor

from funcpar.kernels.dispatch import current_mode, inplace_allowed, use_kernels

__all__ = [
    "BLOCK",
    "KERNEL_DTYPES",
    "NUM_WARPS",
    "LeafGroup",
    "combine_fn",
    "device_scalars",
    "group_by",
    "interpreting",
    "kernel_dtype_ok",
    "kernels_apply",
    "launch",
    "launch_counter",
    "lazy_kernels",
    "leaf_table",
    "leaf_tile",
    "new_output",
    "note_launch",
    "output_into",
    "poisoned_outputs",
    "segment_sums",
    "tile_table",
    "tl_dtype",
    "to_device",
]

#: Elements per program. 1024 fp32 elements are 8 per thread at 4 warps: two 16-byte vector
#: accesses per tensor, the usual shape of a bandwidth-bound elementwise kernel.
BLOCK = 1024
NUM_WARPS = 4
#: The dtypes the kernels load and store (arithmetic is float32); float64 and complex leaves
#: take the plain-torch reference.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_poison: list[bool] = []
# The active launch_counter records (innermost last).
_counters: list[list[str]] = []


def interpreting() -> bool:
    """Whether Triton kernels built now run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def lazy_kernels(build: Callable[[], Any]) -> Callable[[], Any]:
    """``build()`` (which imports Triton and defines the kernels) run once per mode.

    Triton decides when a kernel is *defined* whether it runs interpreted, so kernels built
    under ``TRITON_INTERPRET=1`` are kept apart from compiled ones.
    """
    built: dict[bool, Any] = {}

    def get() -> Any:
        key = interpreting()
        if key not in built:
            built[key] = build()
        return built[key]

    return get


def tl_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
            torch.uint8: tl.uint8, torch.float64: tl.float64}[dtype]


def kernel_dtype_ok(*tensors: Tensor | None) -> bool:
    """Every tensor (``None`` ignored) has a dtype the kernels handle."""
    return all(t is None or t.dtype in KERNEL_DTYPES for t in tensors)


def kernels_apply(*tensors: Any, same_device: bool = False, hyper: Sequence[Any] = ()) -> bool:
    """Whether a step over ``tensors`` runs the kernels: every one is a tensor of a kernel dtype
    (``same_device``: and all are on one device), and :func:`funcpar.kernels.use_kernels` says
    so (asked last: in ``triton`` mode it raises where the kernels cannot run; ``hyper``, the
    step's hyperparameters, count for its differentiability check only)."""
    if not tensors or not (torch.is_tensor(tensors[0]) and tensors[0].is_cuda):
        # Mode auto runs kernels on CUDA tensors only: the usual CPU answer without scanning
        # every leaf (this is asked once per optimizer step).
        if current_mode() == "auto":
            return False
    return (all(torch.is_tensor(t) for t in tensors) and kernel_dtype_ok(*tensors)
            and (not same_device or len({t.device for t in tensors}) <= 1)
            and use_kernels(*tensors, hyper=hyper))


def note_launch(name: str) -> None:
    """Record one kernel launch named ``name`` in every active :func:`launch_counter`."""
    for rec in _counters:
        rec.append(name)


@contextlib.contextmanager
def launch_counter() -> Iterator[list[str]]:
    """Tests and benchmarks: the names of the kernel launches made inside the context, in
    order: those of :func:`launch`, :meth:`LeafGroup.launch` and :func:`segment_sums` (every
    launch of the multi-tensor and factored kernels)."""
    rec: list[str] = []
    _counters.append(rec)
    try:
        yield rec
    finally:
        _counters.remove(rec)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, recorded by :func:`launch_counter`."""
    note_launch(getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None),
                                                            "__name__", "kernel"))
    kernel[grid](*args, **meta)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Tests: kernel outputs start as NaN (255 for uint8) instead of uninitialised memory, so an
    element a kernel fails to write shows."""
    _poison.append(True)
    try:
        yield
    finally:
        _poison.pop()


def new_output(shape: Sequence[int] | torch.Size, dtype: torch.dtype,
               device: torch.device) -> Tensor:
    """A fresh contiguous output tensor for a kernel to fill completely."""
    if _poison:
        fill = 255 if dtype == torch.uint8 else float("nan")
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def output_into(src: Tensor, dtype: torch.dtype) -> Tensor:
    """The output of an elementwise kernel that reads ``src`` (a contiguous input) at the
    offsets it writes: ``src`` itself inside :func:`~funcpar.kernels.inplace.inplace_updates`
    when the dtypes agree (a donated step then needs no second copy of the state; every
    element is loaded before its new value, which depends on it, is stored), else a fresh
    tensor (:func:`new_output`)."""
    if inplace_allowed() and src.dtype == dtype and src.is_contiguous():
        return src
    return new_output(src.shape, dtype, src.device)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    # A pageable host buffer is staged by the driver before cudaMemcpyAsync returns, so the
    # non-blocking copy is safe and waits for nothing queued on the stream.
    return t if t.device == device else t.to(device, non_blocking=True)


def leaf_table(rows: Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """``rows`` (numel, flags, addresses...) as an int64 tensor on ``device``."""
    return to_device(torch.tensor(rows, dtype=torch.int64), device)


@functools.lru_cache(maxsize=64)
def _tile_table(numels: tuple[int, ...], block: int, device: str) -> tuple[Tensor, Tensor]:
    counts = torch.tensor([-(-n // block) for n in numels], dtype=torch.int64)
    first = torch.zeros(len(numels) + 1, dtype=torch.int64)
    first[1:] = counts.cumsum(0)
    leaf = torch.repeat_interleave(torch.arange(len(numels)), counts)
    tile = torch.arange(int(first[-1])) - first[:-1][leaf]
    table = torch.stack([leaf, tile], dim=1).to(torch.int32).contiguous()
    return table.to(device), first.to(torch.int32).to(device)


def tile_table(numels: Sequence[int], block: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(tiles, first)``: ``tiles[i] = (leaf, tile)`` for program ``i`` (leaves in order, each
    cut into ``ceil(numel / block)`` tiles) and ``first[j]`` the first program of leaf ``j``
    (``first[-1]`` = the number of programs). Cached on the device per sizes."""
    if any(n >= 2**31 * block for n in numels):
        raise ValueError(f"a leaf of {max(numels)} elements has more than 2**31 tiles of {block}")
    return _tile_table(tuple(int(n) for n in numels), int(block), str(device))


def group_by(n: int, key: Callable[[int], Hashable]) -> dict[Any, list[int]]:
    """The leaf indices ``0..n-1`` grouped by ``key(i)`` (a device and dtypes: the leaves that
    share one launch), groups and members in index order."""
    groups: dict[Any, list[int]] = {}
    for i in range(n):
        groups.setdefault(key(i), []).append(i)
    return groups


class LeafGroup:
    """The leaves of one launch on ``device``, cut into tiles of ``block`` elements.

    :meth:`add` appends a leaf's row of the leaf table, ``[numel, flag, addresses...]``, and
    keeps its tensors alive until the launch (the table holds raw addresses). :meth:`launch`
    runs ``kernel[(n_tiles,)](table, tiles, *args, NCOL=<row length>, BLOCK=block, **meta)``
    with :data:`NUM_WARPS` warps.
    """

    def __init__(self, device: torch.device, block: int) -> None:
        self.device = device
        self.block = block
        self.rows: list[list[int]] = []
        self.numels: list[int] = []
        #: The indices of the leaves added (the empty ones are not).
        self.live: list[int] = []
        self._keep: list[tuple[Tensor | None, ...]] = []
        self._tiles: tuple[Tensor, Tensor] | None = None

    def add(self, i: int, flag: Any, *tensors: Tensor | None) -> None:
        """Leaf ``i`` with its flag (say, weight decay applies) and the contiguous tensors whose
        addresses make its row, the parameter first (its ``numel`` is the leaf's); ``None`` is
        an unused slot (address 0). An empty leaf is skipped: its outputs have no elements."""
        numel = tensors[0].numel()
        if numel == 0:
            return
        self._keep.append(tensors)
        self.live.append(i)
        self.numels.append(numel)
        self.rows.append([numel, int(bool(flag)),
                          *(0 if t is None else t.data_ptr() for t in tensors)])

    def __bool__(self) -> bool:
        return bool(self.rows)

    def tiles(self) -> tuple[Tensor, Tensor]:
        """``(tiles, first)`` of :func:`tile_table` for the leaves added."""
        if self._tiles is None:
            self._tiles = tile_table(self.numels, self.block, self.device)
        return self._tiles

    @property
    def aligned(self) -> bool:
        """Whether every tensor added starts on a 16-byte boundary, so that a kernel may read and
        write its full tiles with 16-byte vector accesses (``ALIGNED``, see
        :mod:`funcpar.kernels._access`). A fresh allocation always does (the caching allocator
        aligns to 512 bytes); a view into a flat buffer (a ZeRO partition, say) need not."""
        return all(t is None or t.data_ptr() % 16 == 0 for ts in self._keep for t in ts)

    def launch(self, kernel: Any, *args: Any, **meta: Any) -> None:
        """One launch over every tile of the leaves added; their tensors are released after
        it (the caching allocator reuses the memory only after the launch on the stream)."""
        table = leaf_table(self.rows, self.device)
        tiles, _first = self.tiles()
        launch(kernel, (tiles.shape[0],), table, tiles, *args, NCOL=len(self.rows[0]),
               BLOCK=self.block, **meta, num_warps=NUM_WARPS)
        self._keep.clear()


def device_scalars(values: Sequence[Tensor | float], device: torch.device) -> Tensor:
    """The hyperparameters ``values`` as one float32 vector on ``device``, without a host sync.

    Each value is first a float64 (a Python float exactly, a 0-d tensor as it is), then rounded
    to float32 once: what torch does to a 0-d float64 tensor or a Python scalar multiplied
    with a float32 tensor.
    """
    parts = [v.detach().reshape(()).to(torch.float64) if torch.is_tensor(v)
             else torch.tensor(float(v), dtype=torch.float64) for v in values]
    on = {p.device for p in parts}
    if len(on) > 1:  # scheduled values on the device next to constants on the host
        parts = [to_device(p, device) for p in parts]
    return to_device(torch.stack(parts).to(torch.float32), device)


def _build_combine():
    import triton

    @triton.jit
    @no_type_check
    def add_combine(a, b):
        # Our own combine function, not tl.sum's: Triton's standard library is decorated when
        # Triton is imported, so under TRITON_INTERPRET=1 set later it would not be interpreted.
        return a + b

    return add_combine


#: ``combine_fn()``: the ``a + b`` combine function for ``tl.reduce`` in the current mode. A
#: kernel module binds it to its global ``add_combine`` before defining the kernels that use it
#: (a kernel finds the functions it calls among its module's globals).
combine_fn = lazy_kernels(_build_combine)


def _build_leaf_tile():
    global tl, triton
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check
    def leaf_tile(table, tiles, NCOL: tl.constexpr, BLOCK: tl.constexpr):
        # This program's tile: its index, its leaf and the leaf's table row, the element
        # offsets, the leaf's numel and decay flag (the first two columns of every row).
        pid = tl.program_id(0)
        leaf = tl.load(tiles + 2 * pid).to(tl.int64)
        offs = tl.load(tiles + 2 * pid + 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        row = table + leaf * NCOL
        return pid, leaf, row, offs, tl.load(row), tl.load(row + 1)

    return leaf_tile


#: ``leaf_tile()``: the tile prologue every multi-tensor kernel starts with, bound by a kernel
#: module to its global ``leaf_tile`` before defining its kernels (as ``combine_fn``).
leaf_tile = lazy_kernels(_build_leaf_tile)


def _build_segment():
    global tl, triton, add_combine
    import triton
    import triton.language as tl

    add_combine = combine_fn()

    @triton.jit
    @no_type_check
    def segment_sum_kernel(partials, first, out, N_COLS: tl.constexpr, BLOCK: tl.constexpr):
        # One program per leaf sums that leaf's tile partials in a fixed order (float64), so a
        # step is reproducible bit for bit (atomics would add in arrival order).
        leaf = tl.program_id(0)
        lo = tl.load(first + leaf)
        hi = tl.load(first + leaf + 1)
        for c in tl.static_range(N_COLS):
            acc = tl.full([BLOCK], 0, tl.float64)
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                acc += tl.load(partials + offs.to(tl.int64) * N_COLS + c, mask=offs < hi,
                               other=0.0).to(tl.float64)
            tl.store(out + leaf * N_COLS + c, tl.reduce(acc, 0, add_combine))

    return segment_sum_kernel


_segment_kernel = lazy_kernels(_build_segment)


def segment_sums(partials: Tensor, first: Tensor) -> Tensor:
    """Per-leaf sums (float64, ``[n_leaves, n_cols]``) of per-tile ``partials``
    (``[n_tiles, n_cols]``); leaf ``j`` owns the tiles ``first[j]:first[j+1]``."""
    n_leaves = first.numel() - 1
    n_cols = partials.shape[1]
    out = new_output((n_leaves, n_cols), torch.float64, partials.device)
    if n_leaves:
        launch(_segment_kernel(), (n_leaves,), partials, first, out, N_COLS=n_cols, BLOCK=256)
    return out
