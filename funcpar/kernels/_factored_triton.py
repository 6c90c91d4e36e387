"""Triton kernels of :mod:`funcpar.kernels.factored` (imported on first use, so that importing
funcpar never imports Triton; see that module for the passes and their references).

**One launch per pass for many leaves.** Each ``*_many`` function takes the calls of one pass
for any number of leaves and launches its kernel once per *launch group* (leaves that share the
device, the dtypes and the tile shape), not once per leaf, in the manner of
:mod:`funcpar.kernels._launch` (AdamW's multi-tensor kernels):

* a leaf is viewed as ``(B, n, m)``: a factored leaf as its leading dims times its last two, an
  unfactored one *flat*, as ``ceil(numel / BC)`` rows of ``BC`` (the tail masked by ``numel``);
* the leaves of a group are cut into ``BR x BC`` tiles (at most 4096 elements, fewer rows for
  a group of short leaves; ``BC`` one of :data:`BC_CLASSES` chosen from ``m``: the tile shape is
  a compile-time constant, so the width is part of the group key); a *tile table* (int32
  ``(leaf, b * row blocks + row block, column block)`` per program, cached on the device per
  shapes) tells program ``i`` what to do;
* a *leaf table* (int64, one row per leaf, rebuilt per call: the tensors are new every step)
  holds the leaf's geometry, its flags and the raw addresses of its tensors; the kernel casts
  an address back to a typed pointer, so leaves of any sizes share a launch without a copy;
* per-leaf scalars (the clip divisor and ``mean(R)`` live on the device; hyperparameters on the
  host or the device) go as one float32 table ``[leaves, k]``, rounded to float32 once as the
  references' ``.to(float32)`` rounds them, built without a host sync (:func:`_scalar_table`).

Row/column sums and norms leave the main kernel as per-tile partials in one flat buffer per
launch; a second kernel (:func:`_segsum_kernel`) sums each row's, column's or leaf's partials in
a fixed order (deterministic, no atomics) into one flat result buffer, whose slices are the
per-leaf results. So a pass costs one launch (the update pass) or two (passes with sums) per
group, plus a few small copies for the tables, whatever the number of leaves.

Every arithmetic step that the reference rounds is rounded the same way here (``div_rn``/
``sqrt_rn``: IEEE division and square root, as torch's CPU ops; ``rsqrt`` as ``1 / sqrt``, as
torch computes it on CPU), so the differences from the reference are the summation order and,
on GPUs, contracted multiply-adds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, no_type_check

import torch
import triton
import triton.language as tl
from torch import Tensor

from funcpar.kernels import _launch
from funcpar.kernels import factored as F

# Tiles of this many elements (16 KB of float32 per tensor read).
_TILE = 4096
#: The tile widths: a leaf takes the smallest that holds its last dim (256 beyond); flat
#: (unfactored) leaves take 256. Leaves of different widths are launched apart.
BC_CLASSES = (16, 64, 256)
_FLAT_BC = 256
# Segment sums: SB segments per program, LB partials of each per step.
_SB, _LB = 32, 32
# 16 warps: 8 elements of a 4096-element tile per thread. Compiled for sm_90
# (benchmarks/compile_kernels.py) at 4 warps (32 per thread) the passes took 197-255
# registers and the bf16 update pass spilled 40-96 B per thread to local memory; at 16 the
# most is 104 registers and nothing spills. Occupancy at 104 registers: one 16-warp program per
# SM (untimed: no GPU yet; fewer elements per tile would raise it at the cost of more row and
# column partials).
_NUM_WARPS = 16

# Leaf-table columns shared by every kernel (then each kernel's pointers from column _PTR).
_N, _M, _NUMEL, _NRB, _NCB, _FLAGS, _OFF_A, _OFF_B, _PTR = range(9)
# precond_apply flags: the preconditioner's kind in the low two bits, then one bit per step.
_KIND_MASK, _HAS_CLIP, _HAS_PRE, _MOMENTUM, _HAS_POST, _HAS_DECAY = 3, 4, 8, 16, 32, 64
_PRECOND_KINDS = {"none": 0, "factored": 1, "full": 2}


# --------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------


@triton.jit
@no_type_check  # the jaxtyping import hook must leave the kernels' source as written
def _mtile(table, tiles, NCOL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    # This program's tile: its leaf's table row, geometry and flags, the tile's (b, row block,
    # column block), its rows and columns with their masks, the element offsets and mask.
    pid = tl.program_id(0)
    leaf = tl.load(tiles + 3 * pid).to(tl.int64)
    pid_r = tl.load(tiles + 3 * pid + 1).to(tl.int64)
    pid_c = tl.load(tiles + 3 * pid + 2).to(tl.int64)
    row = table + leaf * NCOL
    n = tl.load(row + 0)
    m = tl.load(row + 1)
    numel = tl.load(row + 2)
    n_rb = tl.load(row + 3)
    b = pid_r // n_rb
    rb = pid_r % n_rb
    rows = rb * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    rmask = rows < n
    cmask = cols < m
    off = b * n * m + rows[:, None] * m + cols[None, :]
    # numel: the tail of a flat leaf (its last row is partly past the end).
    mask = rmask[:, None] & cmask[None, :] & (off < numel)
    return pid, leaf, row, b, rb, pid_c, rows, cols, rmask, cmask, off, mask, n, m, n_rb


@triton.jit
@no_type_check
def _ptr(row, col, DT: tl.constexpr):
    return tl.load(row + col).to(tl.pointer_type(DT))


@triton.jit
@no_type_check
def _rsqrt(x):
    # 1 / sqrt(x), both correctly rounded: torch's CPU rsqrt.
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(x))


@triton.jit
@no_type_check
def _factored_inv(row, c0, b, rows, cols, rmask, cmask, n, m):
    # rsqrt(R / mean(R)) (x) rsqrt(C), the reference's order of operations; the factors'
    # pointers are in table columns c0, c0 + 1, c0 + 2 (row, col, mean; float32).
    r = tl.load(_ptr(row, c0, tl.float32) + b * n + rows, mask=rmask, other=1.0)
    c = tl.load(_ptr(row, c0 + 1, tl.float32) + b * m + cols, mask=cmask, other=1.0)
    mu = tl.load(_ptr(row, c0 + 2, tl.float32) + b)
    rr = _rsqrt(tl.math.div_rn(r, mu))
    cc = _rsqrt(c)
    return rr[:, None] * cc[None, :]


@triton.jit
@no_type_check
def _store_row_col(x, row, part, b, rb, pid_c, rows, cols, rmask, cmask, n, m, n_rb):
    # Per-tile partial sums into the launch's flat buffer: row r of batch b at
    # off_a + (b n + r) n_cb + column block; column c at off_b + (b m + c) n_rb + row block
    # (each row's / column's partials contiguous, for _segsum_kernel).
    n_cb = tl.load(row + 4)
    off_a = tl.load(row + 6)
    off_b = tl.load(row + 7)
    tl.store(part + off_a + (b * n + rows) * n_cb + pid_c, tl.sum(x, axis=1), mask=rmask)
    tl.store(part + off_b + (b * m + cols) * n_rb + rb, tl.sum(x, axis=0), mask=cmask)


# --------------------------------------------------------------------------------------------
# kernels (table columns from _PTR = 8 on are each kernel's own)
# --------------------------------------------------------------------------------------------


@triton.jit
@no_type_check
def _sq_sums_kernel(table, tiles, scal, part, NCOL: tl.constexpr, G: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr):
    # cols: 8 g. scalars: eps.
    (_pid, leaf, row, b, rb, pid_c, rows, cols, rmask, cmask, off, mask, n, m,
     n_rb) = _mtile(table, tiles, NCOL, BR, BC)
    eps = tl.load(scal + leaf)
    g = tl.load(_ptr(row, 8, G) + off, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(mask, g * g + eps, 0.0)
    _store_row_col(x, row, part, b, rb, pid_c, rows, cols, rmask, cmask, n, m, n_rb)


@triton.jit
@no_type_check
def _norm_kernel(table, tiles, scal, part, NCOL: tl.constexpr, G: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr):
    # Per tile: sum of (g rsqrt(V))^2, V factored (flag 1) or full and updated here (V'
    # stored). cols: 8 g, 9-11 row/col/mean (factored), 12 V, 13 V' (full). scalars: d, 1-d,
    # eps.
    (pid, leaf, row, b, _rb, _pid_c, rows, cols, rmask, cmask, off, mask, n, m,
     _n_rb) = _mtile(table, tiles, NCOL, BR, BC)
    g = tl.load(_ptr(row, 8, G) + off, mask=mask, other=0.0).to(tl.float32)
    u = g
    if tl.load(row + 5) == 1:
        u = _factored_inv(row, 9, b, rows, cols, rmask, cmask, n, m) * g
    else:
        d = tl.load(scal + 3 * leaf)
        omd = tl.load(scal + 3 * leaf + 1)
        eps = tl.load(scal + 3 * leaf + 2)
        v = tl.load(_ptr(row, 12, tl.float32) + off, mask=mask, other=1.0)
        v = v * d + (g * g + eps) * omd
        tl.store(_ptr(row, 13, tl.float32) + off, v, mask=mask)
        u = _rsqrt(v) * g
    tl.store(part + pid, tl.sum(tl.sum(tl.where(mask, u * u, 0.0), axis=1), axis=0))


@triton.jit
@no_type_check
def _came_res_kernel(table, tiles, scal, part, NCOL: tl.constexpr, G: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr):
    # cols: 8 g, 9-11 row/col/mean, 12 M, 13 M'. scalars: clip, beta1, 1-beta1, eps2.
    (_pid, leaf, row, b, rb, pid_c, rows, cols, rmask, cmask, off, mask, n, m,
     n_rb) = _mtile(table, tiles, NCOL, BR, BC)
    clip = tl.load(scal + 4 * leaf)
    d1 = tl.load(scal + 4 * leaf + 1)
    omd1 = tl.load(scal + 4 * leaf + 2)
    eps2 = tl.load(scal + 4 * leaf + 3)
    g = tl.load(_ptr(row, 8, G) + off, mask=mask, other=0.0).to(tl.float32)
    u = _factored_inv(row, 9, b, rows, cols, rmask, cmask, n, m) * g
    u = tl.math.div_rn(u, clip)
    mo = tl.load(_ptr(row, 12, tl.float32) + off, mask=mask, other=0.0)
    mn = mo * d1 + u * omd1
    tl.store(_ptr(row, 13, tl.float32) + off, mn, mask=mask)
    r = u - mn
    x = tl.where(mask, r * r + eps2, 0.0)
    _store_row_col(x, row, part, b, rb, pid_c, rows, cols, rmask, cmask, n, m, n_rb)


@triton.jit
@no_type_check
def _apply_kernel(table, tiles, scal, NCOL: tl.constexpr, X: tl.constexpr, P: tl.constexpr,
                  OUT_DT: tl.constexpr, OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    # OUT (per launch): 0 direction, 1 update, 2 param. Per leaf (flags): the preconditioner's
    # kind (0 none, 1 factored, 2 full) and which steps apply. cols: 8 x, 9 p, 10 out, 11 M,
    # 12 M', 13-15 row/col/mean, 16 V. scalars: clip, pre, post, decay, beta1, 1-beta1.
    (_pid, leaf, row, b, _rb, _pid_c, rows, cols, rmask, cmask, off, mask, n, m,
     _n_rb) = _mtile(table, tiles, NCOL, BR, BC)
    flags = tl.load(row + 5)
    kind = flags & 3
    s = scal + 6 * leaf
    y = tl.load(_ptr(row, 8, X) + off, mask=mask, other=0.0).to(tl.float32)
    if kind == 1:
        y = _factored_inv(row, 13, b, rows, cols, rmask, cmask, n, m) * y
    if kind == 2:
        v = tl.load(_ptr(row, 16, tl.float32) + off, mask=mask, other=1.0)
        y = _rsqrt(v) * y
    if (flags & 4) != 0:
        y = tl.math.div_rn(y, tl.load(s))
    if (flags & 8) != 0:
        y = y * tl.load(s + 1)
    if (flags & 16) != 0:
        mo = tl.load(_ptr(row, 11, tl.float32) + off, mask=mask, other=0.0)
        y = mo * tl.load(s + 4) + y * tl.load(s + 5)
        tl.store(_ptr(row, 12, tl.float32) + off, y, mask=mask)
    if (flags & 32) != 0:
        y = y * tl.load(s + 2)
    if OUT == 0:
        tl.store(_ptr(row, 10, OUT_DT) + off, y, mask=mask)
    else:
        p = tl.load(_ptr(row, 9, P) + off, mask=mask, other=0.0).to(tl.float32)
        q = p
        if (flags & 64) != 0:
            # p + p * (-decay): the reference's addcmul with the negated coefficient.
            q = p - p * tl.load(s + 3)
        q = q - y
        if OUT == 1:
            tl.store(_ptr(row, 10, OUT_DT) + off, q - p, mask=mask)
        else:
            tl.store(_ptr(row, 10, OUT_DT) + off, q.to(OUT_DT, fp_downcast_rounding="rtne"),
                     mask=mask)


@triton.jit
@no_type_check
def _segsum_kernel(segs, progs, part, out, SB: tl.constexpr, LB: tl.constexpr):
    # Segment group i (row of segs): `count` segments of `length` partials each, contiguous
    # from part[in_off]; their sums go to out[out_off:]. A program sums SB segments of one
    # group, LB partials at a time, in a fixed order (reproducible: no atomics).
    pid = tl.program_id(0)
    grp = tl.load(progs + 2 * pid).to(tl.int64)
    blk = tl.load(progs + 2 * pid + 1).to(tl.int64)
    count = tl.load(segs + 4 * grp)
    length = tl.load(segs + 4 * grp + 1)
    in_off = tl.load(segs + 4 * grp + 2)
    out_off = tl.load(segs + 4 * grp + 3)
    idx = blk * SB + tl.arange(0, SB)
    smask = idx < count
    acc = tl.zeros([SB], dtype=tl.float32)
    for k0 in range(0, length, LB):
        ks = k0 + tl.arange(0, LB)
        x = tl.load(part + in_off + idx[:, None] * length + ks[None, :],
                    mask=smask[:, None] & (ks < length)[None, :], other=0.0)
        acc += tl.sum(x, axis=1)
    tl.store(out + out_off + idx, acc, mask=smask)


# --------------------------------------------------------------------------------------------
# host side: views, plans (cached per shapes), tables
# --------------------------------------------------------------------------------------------


class _View(NamedTuple):
    """A leaf as ``(B, n, m)`` with its element count and tile width."""

    b: int
    n: int
    m: int
    numel: int
    bc: int


def _width(m: int) -> int:
    return next((c for c in BC_CLASSES if m <= c), BC_CLASSES[-1])


def _view(x: Tensor, factored: bool, bc: int = _FLAT_BC) -> _View:
    """A factored leaf as ``(B, n, m)`` with the tile width for ``m``; a flat one as rows of
    ``bc`` (any width fits a flat leaf, so it can join any launch)."""
    numel = x.numel()
    if factored:
        n, m = x.shape[-2], x.shape[-1]
        return _View(numel // (n * m), n, m, numel, _width(m))
    return _View(1, -(-numel // bc), bc, numel, bc)


class _Plan(NamedTuple):
    """What a launch over leaves of these views needs that depends on their shapes only."""

    tiles: Tensor  # int32 [programs, 3]: (leaf, b * n_rb + row block, column block)
    br: int  # rows per tile (the kernel's BR)
    n_rb: tuple[int, ...]
    n_cb: tuple[int, ...]
    first: tuple[int, ...]  # first program of each leaf (+ the total)
    # Row/column partial sums: offsets of each leaf's row and column partials in the flat
    # partial buffer, of its row and column sums in the flat result; buffer sizes.
    row_part: tuple[int, ...]
    col_part: tuple[int, ...]
    row_out: tuple[int, ...]
    col_out: tuple[int, ...]
    rc_part_size: int
    rc_out_size: int
    rc_segs: tuple[Tensor, Tensor]  # _segsum_kernel tables for the row/column sums
    norm_segs: tuple[Tensor, Tensor]  # ... for one sum per leaf of its tiles' partials


def _seg_tables(groups: list[tuple[int, int, int, int]], device: str) -> tuple[Tensor, Tensor]:
    segs = torch.tensor(groups, dtype=torch.int64).reshape(-1, 4)
    progs = [(g, k) for g, (count, _l, _i, _o) in enumerate(groups)
             for k in range(-(-count // _SB))]
    progs_t = torch.tensor(progs, dtype=torch.int32).reshape(-1, 2)
    return segs.to(device), progs_t.to(device)


@functools.lru_cache(maxsize=128)
def _plan(views: tuple[_View, ...], bc: int, device: str) -> _Plan:
    # Rows per tile: as many as fit 4096 elements, but no more than the group's tallest leaf
    # needs (a group of small leaves takes small tiles: no launch of mostly masked lanes).
    br = min(_TILE // bc, 1 << max(0, (max(v.n for v in views) - 1).bit_length()))
    n_rb = tuple(-(-v.n // br) for v in views)
    n_cb = tuple(-(-v.m // bc) for v in views)
    counts = torch.tensor([v.b * r * c for v, r, c in zip(views, n_rb, n_cb)], dtype=torch.int64)
    first = torch.zeros(len(views) + 1, dtype=torch.int64)
    first[1:] = counts.cumsum(0)
    leaf = torch.repeat_interleave(torch.arange(len(views)), counts)
    local = torch.arange(int(first[-1])) - first[:-1][leaf]
    ncb_t = torch.tensor(n_cb, dtype=torch.int64)[leaf]
    tiles = torch.stack([leaf, local // ncb_t, local % ncb_t], dim=1).to(torch.int32)
    row_part, col_part, row_out, col_out = [], [], [], []
    rc_groups, norm_groups = [], []
    pos = out = 0
    for j, (v, r, c) in enumerate(zip(views, n_rb, n_cb)):
        row_part.append(pos)
        pos += v.b * v.n * c
        col_part.append(pos)
        pos += v.b * v.m * r
        row_out.append(out)
        out += v.b * v.n
        col_out.append(out)
        out += v.b * v.m
        rc_groups += [(v.b * v.n, c, row_part[-1], row_out[-1]),
                      (v.b * v.m, r, col_part[-1], col_out[-1])]
        norm_groups.append((1, int(counts[j]), int(first[j]), j))
    return _Plan(tiles.contiguous().to(device), br, n_rb, n_cb, tuple(int(x) for x in first),
                 tuple(row_part), tuple(col_part), tuple(row_out), tuple(col_out), pos, out,
                 _seg_tables(rc_groups, device), _seg_tables(norm_groups, device))


def _alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if F._POISON:
        t.fill_(float("nan"))
    return t


def _addr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _f64(x: float | Tensor) -> float | Tensor:
    """A host scalar as a Python float (exact: float64), a device one as it is."""
    if torch.is_tensor(x):
        if x.device.type == "cpu":
            return float(x.detach().reshape(()).to(torch.float64))
        return x.detach().reshape(())
    return float(x)


def _scalar_table(rows: list[list[float | Tensor]], device: torch.device) -> Tensor:
    """Per-leaf scalars as a float32 ``[leaves, k]`` table on ``device``.

    Host values (Python numbers, CPU tensors) are rounded from float64 to float32 on the host
    and copied in one transfer; device values are stacked per dtype and rounded there. Either
    way each is rounded once, as the reference's ``.to(float32)`` of a 0-d tensor (or a
    Python number through float64) rounds it, and the host never waits for the device.
    """
    k = len(rows[0]) if rows else 0
    host: list[float] = []
    on_dev: dict[torch.dtype, tuple[list[int], list[Tensor]]] = {}
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            v = _f64(v)
            if torch.is_tensor(v):
                if v.device != device:
                    raise ValueError(f"a scalar on {v.device} for a launch on {device}")
                idx, vals = on_dev.setdefault(v.dtype, ([], []))
                idx.append(i * k + j)
                vals.append(v)
                host.append(0.0)
            else:
                host.append(v)
    table = torch.tensor(host, dtype=torch.float64).to(torch.float32)
    table = _launch.to_device(table, device)
    for idx, vals in on_dev.values():
        where = _launch.to_device(torch.tensor(idx, dtype=torch.int64), device)
        table[where] = torch.stack(vals).to(torch.float32)
    return table.reshape(len(rows), k)


def _ema_pair(decay: float | Tensor) -> tuple[float | Tensor, float | Tensor]:
    """``decay`` and ``1 - decay`` (in float64) as :func:`funcpar.kernels.factored.ema` forms
    them, before their rounding to float32."""
    d = _f64(decay)
    return d, 1.0 - d


def _factors(f: F.Factors) -> list[Tensor]:
    return [t.to(torch.float32).contiguous() for t in f]


def _groups(items: Sequence[Any], key) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for i, it in enumerate(items):
        out.setdefault(key(it), []).append(i)
    return out


def _launch_main(kernel: Any, plan: _Plan, rows: list[list[int]], scal: Tensor,
                 device: torch.device, *args: Any, **meta: Any) -> None:
    table = _launch.leaf_table(rows, device)
    _launch.launch(kernel, (plan.tiles.shape[0],), table, plan.tiles, scal, *args,
                   NCOL=len(rows[0]), num_warps=_NUM_WARPS, **meta)


def _segsum(segs: tuple[Tensor, Tensor], part: Tensor, size: int,
            device: torch.device) -> Tensor:
    out = _alloc((size,), torch.float32, device)
    _launch.launch(_segsum_kernel, (segs[1].shape[0],), segs[0], segs[1], part, out, SB=_SB,
                   LB=_LB, num_warps=_NUM_WARPS)
    return out


def _geometry(v: _View, plan: _Plan, j: int, flags: int, off_a: int = 0,
              off_b: int = 0) -> list[int]:
    return [v.n, v.m, v.numel, plan.n_rb[j], plan.n_cb[j], flags, off_a, off_b]


# --------------------------------------------------------------------------------------------
# the passes over many leaves (same results as the references, one launch per group)
# --------------------------------------------------------------------------------------------


def _row_col_launch(kernel: Any, g_list: list[Tensor], extra_ptrs: list[list[int]],
                    scal_rows: list[list[Any]]) -> list[tuple[Tensor, Tensor]]:
    """Launch ``kernel`` (row/column partial sums) over leaves of one group; their sums. The
    caller keeps the tensors whose addresses are in ``extra_ptrs`` alive until it returns."""
    device = g_list[0].device
    views = tuple(_view(g, True) for g in g_list)
    plan = _plan(views, views[0].bc, str(device))
    part = _alloc((plan.rc_part_size,), torch.float32, device)
    rows = [_geometry(v, plan, j, 0, plan.row_part[j], plan.col_part[j]) + [_addr(g)] + ptrs
            for j, (v, g, ptrs) in enumerate(zip(views, g_list, extra_ptrs))]
    scal = _scalar_table(scal_rows, device)
    _launch_main(kernel, plan, rows, scal, device, part, G=_launch.tl_dtype(g_list[0].dtype),
                 BR=plan.br, BC=views[0].bc)
    sums = _segsum(plan.rc_segs, part, plan.rc_out_size, device)
    out = []
    for j, (v, g) in enumerate(zip(views, g_list)):
        lead = tuple(g.shape[:-2])
        r = sums[plan.row_out[j]:plan.row_out[j] + v.b * v.n].view(lead + (v.n, 1))
        c = sums[plan.col_out[j]:plan.col_out[j] + v.b * v.m].view(lead + (1, v.m))
        out.append((r, c))
    return out


def _key(t: Tensor, factored: bool) -> tuple:
    return (t.device, t.dtype, _view(t, factored).bc)


def sq_row_col_sums_many(calls: Sequence[tuple[Tensor, float]]) -> list[tuple[Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.sq_row_col_sums_reference` of each ``(g, eps)``."""
    results: list[Any] = [None] * len(calls)
    gs = [c[0].contiguous() for c in calls]
    for idx in _groups(gs, lambda g: _key(g, True)).values():
        got = _row_col_launch(_sq_sums_kernel, [gs[i] for i in idx], [[] for _ in idx],
                              [[calls[i][1]] for i in idx])
        for i, r in zip(idx, got):
            results[i] = r
    return results


def came_residual_many(calls: Sequence[tuple]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.came_residual_reference` of each
    ``(g, factors, clip, m, beta1, eps2)``."""
    results: list[Any] = [None] * len(calls)
    gs = [c[0].contiguous() for c in calls]
    for idx in _groups(gs, lambda g: _key(g, True)).values():
        keep, ptrs, scal, m_outs = [], [], [], []
        for i in idx:
            g, factors, clip, m_state, beta1, eps2 = calls[i]
            f = _factors(factors)
            mo = m_state.to(torch.float32).contiguous()
            m_out = _alloc(tuple(g.shape), torch.float32, g.device)
            keep += [f, mo]
            m_outs.append(m_out)
            ptrs.append([_addr(t) for t in f] + [_addr(mo), _addr(m_out)])
            scal.append([clip, *_ema_pair(beta1), eps2])
        got = _row_col_launch(_came_res_kernel, [gs[i] for i in idx], ptrs, scal)
        del keep  # (alive until the launch: the table holds raw addresses)
        for i, m_out, (r, c) in zip(idx, m_outs, got):
            results[i] = (m_out, r, c)
    return results


def _norm_many(gs: list[Tensor], factored: bool, per_leaf: list[tuple[list[int], list[Any]]]
               ) -> list[Tensor]:
    device = gs[0].device
    views = tuple(_view(g, factored) for g in gs)
    plan = _plan(views, views[0].bc, str(device))
    part = _alloc((plan.first[-1],), torch.float32, device)
    rows = [_geometry(v, plan, j, int(factored)) + [_addr(g)] + ptrs
            for j, (v, g, (ptrs, _s)) in enumerate(zip(views, gs, per_leaf))]
    scal = _scalar_table([s for _p, s in per_leaf], device)
    _launch_main(_norm_kernel, plan, rows, scal, device, part, G=_launch.tl_dtype(gs[0].dtype),
                 BR=plan.br, BC=views[0].bc)
    norms = _segsum(plan.norm_segs, part, len(gs), device).sqrt()
    return [norms[j] for j in range(len(gs))]


def scaled_norm_many(calls: Sequence[tuple[Tensor, F.Factors]]) -> list[Tensor]:
    """:func:`funcpar.kernels.factored.scaled_norm_reference` of each ``(g, factors)``."""
    results: list[Any] = [None] * len(calls)
    gs = [c[0].contiguous() for c in calls]
    for idx in _groups(gs, lambda g: _key(g, True)).values():
        keep = [_factors(calls[i][1]) for i in idx]
        per_leaf = [([_addr(t) for t in f] + [0, 0], [0.0, 0.0, 0.0]) for f in keep]
        for i, r in zip(idx, _norm_many([gs[i] for i in idx], True, per_leaf)):
            results[i] = r
    return results


def full_moment_many(calls: Sequence[tuple]) -> list[tuple[Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.full_moment_reference` of each
    ``(g, v, decay, eps)``."""
    results: list[Any] = [None] * len(calls)
    gs = [c[0].contiguous() for c in calls]
    for idx in _groups(gs, lambda g: _key(g, False)).values():
        keep, per_leaf, v_outs = [], [], []
        for i in idx:
            g, v, decay, eps = calls[i]
            v = v.to(torch.float32).contiguous()
            v_out = _alloc(tuple(g.shape), torch.float32, g.device)
            keep.append(v)
            v_outs.append(v_out)
            per_leaf.append(([0, 0, 0, _addr(v), _addr(v_out)], [*_ema_pair(decay), eps]))
        for i, v_out, r in zip(idx, v_outs, _norm_many([gs[i] for i in idx], False, per_leaf)):
            results[i] = (v_out, r)
    return results


def precond_apply_many(calls: Sequence[tuple[Tensor, Tensor | None, Any, dict[str, Any]]]
                       ) -> list[tuple[Tensor, Tensor | None]]:
    """:func:`funcpar.kernels.factored.precond_apply_reference` of each
    ``(x, p, precond, kwargs)`` (kwargs: clip, pre, momentum, beta1, post, decay, out)."""
    results: list[Any] = [None] * len(calls)
    xs = [c[0].contiguous() for c in calls]

    def key(i: int) -> tuple:
        _x, p, precond, kw = calls[i]
        out = kw["out"]
        p_dt = None if out == "direction" else p.dtype
        width = _width(xs[i].shape[-1]) if isinstance(precond, F.Factors) else None
        return (xs[i].device, xs[i].dtype, width, p_dt, out)

    # Flat leaves (width None) join the widest group of factored leaves they can share a
    # launch with (any width fits them), else launch in rows of 256.
    groups: dict[tuple, list[int]] = {}
    plain = _groups(range(len(calls)), key)
    for k, idx in plain.items():
        if k[2] is None:
            same = [w[2] for w in plain if w[2] is not None and w[:2] + w[3:] == k[:2] + k[3:]]
            k = k[:2] + (max(same, default=_FLAT_BC),) + k[3:]
        groups.setdefault(k, []).extend(idx)
    for (device, x_dt, bc, p_dt, out), idx in groups.items():
        idx = sorted(idx)
        mode = F.OUT_MODES.index(out)
        out_dt = p_dt if mode == 2 else torch.float32
        keep: list[Any] = []
        views, rows_ptrs, scal, outs = [], [], [], []
        for i in idx:
            x, p, precond, kw = calls[i]
            x = xs[i]
            factored = isinstance(precond, F.Factors)
            kind = 1 if factored else (2 if precond is not None else 0)
            fac = _factors(precond) if factored else [None, None, None]
            v = precond.to(torch.float32).contiguous() if kind == 2 else None
            p_in = None if mode == 0 else p.contiguous()
            mom = kw["momentum"]
            m_in = None if mom is None else mom.to(torch.float32).contiguous()
            m_out = None if mom is None else _alloc(tuple(x.shape), torch.float32, device)
            res = _alloc(tuple(x.shape), out_dt, device)
            keep += [fac, v, p_in, m_in]
            flags = (kind | (_HAS_CLIP if kw["clip"] is not None else 0)
                     | (_HAS_PRE if kw["pre"] is not None else 0)
                     | (_MOMENTUM if mom is not None else 0)
                     | (_HAS_POST if kw["post"] is not None else 0)
                     | (_HAS_DECAY if kw["decay"] is not None and mode != 0 else 0))
            d1, omd1 = _ema_pair(kw["beta1"]) if mom is not None else (0.0, 0.0)
            scal.append([1.0 if kw["clip"] is None else kw["clip"],
                         1.0 if kw["pre"] is None else kw["pre"],
                         1.0 if kw["post"] is None else kw["post"],
                         0.0 if kw["decay"] is None else kw["decay"], d1, omd1])
            views.append(_view(x, factored, bc))
            rows_ptrs.append((flags, [_addr(x), _addr(p_in), _addr(res), _addr(m_in),
                                      _addr(m_out)] + [_addr(t) for t in fac] + [_addr(v)]))
            outs.append((res, m_out))
        plan = _plan(tuple(views), bc, str(device))
        rows = [_geometry(v, plan, j, flags) + ptrs
                for j, (v, (flags, ptrs)) in enumerate(zip(views, rows_ptrs))]
        T = _launch.tl_dtype
        _launch_main(_apply_kernel, plan, rows, _scalar_table(scal, device), device,
                     X=T(x_dt), P=T(p_dt or x_dt), OUT_DT=T(out_dt), OUT=mode, BR=plan.br,
                     BC=bc)
        del keep  # (alive until the launch: the table holds raw addresses)
        for i, r in zip(idx, outs):
            results[i] = r
    return results


@functools.lru_cache(maxsize=128)
def _col_sum_plan(shapes: tuple[tuple[int, int], ...], device: str
                  ) -> tuple[tuple[Tensor, Tensor], tuple[int, ...], int]:
    groups, outs = [], []
    pos = out = 0
    for b, n in shapes:
        groups.append((b, n, pos, out))
        outs.append(out)
        pos += b * n
        out += b
    return _seg_tables(groups, device), tuple(outs), out


def sum_rows_many(xs: Sequence[Tensor], divide_by: Sequence[int | None]) -> list[Tensor]:
    """``x.sum(-2, keepdim=True)`` of each ``(..., n, 1)`` float32 tensor (a row factor), over
    ``divide_by`` where given (a mean), all in one concatenation and one segment-sum launch
    (fixed order); the results are slices of one buffer."""
    device = xs[0].device
    shapes = tuple((x.numel() // x.shape[-2], x.shape[-2]) for x in xs)
    segs, outs, size = _col_sum_plan(shapes, str(device))
    flat = torch.cat([x.reshape(-1).to(torch.float32) for x in xs])
    sums = _segsum(segs, flat, size, device)
    if any(d is not None for d in divide_by):
        div = [float(d or 1) for d, (b, _n) in zip(divide_by, shapes) for _ in range(b)]
        sums = sums / _launch.to_device(torch.tensor(div, dtype=torch.float32), device)
    return [sums[o:o + b].view(tuple(x.shape[:-2]) + (1, 1))
            for x, o, (b, _n) in zip(xs, outs, shapes)]


# --------------------------------------------------------------------------------------------
# one-leaf forms (same signatures and results as the references)
# --------------------------------------------------------------------------------------------


def sq_row_col_sums(g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return sq_row_col_sums_many([(g, eps)])[0]


def scaled_norm(g: Tensor, factors: F.Factors) -> Tensor:
    return scaled_norm_many([(g, factors)])[0]


def full_moment(g: Tensor, v: Tensor, decay: float | Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return full_moment_many([(g, v, decay, eps)])[0]


def came_residual(g: Tensor, factors: F.Factors, clip: Tensor, m_state: Tensor,
                  beta1: float | Tensor, eps2: float) -> tuple[Tensor, Tensor, Tensor]:
    return came_residual_many([(g, factors, clip, m_state, beta1, eps2)])[0]


def precond_apply(x: Tensor, p: Tensor | None, precond: F.Factors | Tensor | None, *,
                  clip=None, pre=None, momentum=None, beta1=None, post=None, decay=None,
                  out: str = "param") -> tuple[Tensor, Tensor | None]:
    kw = dict(clip=clip, pre=pre, momentum=momentum, beta1=beta1, post=post, decay=decay,
              out=out)
    return precond_apply_many([(x, p, precond, kw)])[0]

