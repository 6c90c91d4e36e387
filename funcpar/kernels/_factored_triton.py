"""Triton kernels of :mod:`funcpar.kernels.factored` (imported on first use, so that importing
funcpar never imports Triton; see that module for the passes and their references).

A leaf is viewed as ``(B, n, m)``: a factored leaf as its leading dims times its last two, an
unfactored one as ``(1, 1, numel)``. Programs take ``BR x BC`` tiles on the grid
``(ceil(m / BC), ceil(n / BR) * B)``. Row/column sums leave the kernel as per-tile partials
(``(B, n, column blocks)`` and ``(B, row blocks, m)``) and norms as one partial per tile, summed by
torch afterwards: deterministic, no atomics. Every arithmetic step that the reference rounds is
rounded the same way here (``div_rn``/``sqrt_rn``: IEEE division and square root, as torch's CPU
ops; ``rsqrt`` as ``1 / sqrt``, as torch computes it on CPU), so the differences from the
reference are the summation order and, on GPUs, contracted multiply-adds.
"""

from __future__ import annotations

import math
from typing import Any, no_type_check

import torch
import triton
import triton.language as tl
from torch import Tensor

from funcpar.kernels import factored as F

# Tiles of at most this many elements (16 KB of float32 per tensor read).
_TILE = 4096
_MAX_BC = 256
_MAX_GRID_1 = 65535  # CUDA's limit on the second grid dimension


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _view(x: Tensor, factored: bool) -> tuple[int, int, int]:
    """(B, n, m) of a leaf."""
    if factored:
        n, m = x.shape[-2], x.shape[-1]
        return x.numel() // (n * m), n, m
    return 1, 1, x.numel()


def _grid(b: int, n: int, m: int, who: str) -> tuple[int, int, int, int, tuple[int, int]]:
    bc = min(_MAX_BC, _pow2(m))
    br = min(_pow2(n), max(1, _TILE // bc))
    n_rb, n_cb = triton.cdiv(n, br), triton.cdiv(m, bc)
    if n_rb * b > _MAX_GRID_1:
        raise ValueError(f"{who}: a leaf viewed as (B={b}, n={n}, m={m}) needs {n_rb * b} row "
                         f"blocks of {br}, over the grid limit {_MAX_GRID_1}")
    return br, bc, n_rb, n_cb, (n_cb, n_rb * b)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if F._POISON:
        t.fill_(float("nan"))
    return t


def _sarg(x: float | Tensor | None, device: torch.device) -> tuple[Any, bool]:
    """A scalar for a kernel: ``(value, False)`` when it lives on the host (passed by value: no
    wait for the device), ``(float32 0-d tensor, True)`` when it lives on ``device``. Either way
    it is rounded to float32 as the reference's ``.to(float32)`` rounds it."""
    if x is None:
        return 0.0, False
    if torch.is_tensor(x):
        if x.device == device:
            return x.reshape(()).to(torch.float32).contiguous(), True
        return float(x.to(torch.float32)), False
    return float(torch.tensor(float(x), dtype=torch.float64).to(torch.float32)), False


def _ema_args(decay: float | Tensor, device: torch.device) -> tuple[tuple, tuple]:
    """``decay`` and ``1 - decay`` rounded as :func:`funcpar.kernels.factored.ema` rounds them."""
    d = torch.as_tensor(decay, dtype=torch.float64)
    return _sarg(d, device), _sarg(1 - d, device)


def _factors_args(f: F.Factors) -> tuple[Tensor, Tensor, Tensor]:
    return (f.row.to(torch.float32).contiguous().reshape(-1),
            f.col.to(torch.float32).contiguous().reshape(-1),
            f.row_mean.to(torch.float32).contiguous().reshape(-1))


# --------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------


@triton.jit
@no_type_check  # the jaxtyping import hook must leave the kernels' source as written
def _tile(pid_c, pid_r, n, m, n_rb, BR: tl.constexpr, BC: tl.constexpr):
    b = pid_r // n_rb
    rb = pid_r % n_rb
    rows = rb * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    rmask = rows < n
    cmask = cols < m
    off = b.to(tl.int64) * n * m + rows.to(tl.int64)[:, None] * m + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    return b, rb, rows, cols, rmask, cmask, off, mask


@triton.jit
@no_type_check
def _rsqrt(x):
    # 1 / sqrt(x), both correctly rounded: torch's CPU rsqrt.
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(x))


@triton.jit
@no_type_check
def _scalar(arg, IS_PTR: tl.constexpr):
    if IS_PTR:
        return tl.load(arg)
    else:
        return arg


@triton.jit
@no_type_check
def _factored_inv(row_ptr, col_ptr, mean_ptr, b, rows, cols, rmask, cmask, n, m):
    # rsqrt(R / mean(R)) (x) rsqrt(C): the reference's order of operations.
    r = tl.load(row_ptr + b.to(tl.int64) * n + rows, mask=rmask, other=1.0)
    c = tl.load(col_ptr + b.to(tl.int64) * m + cols, mask=cmask, other=1.0)
    mu = tl.load(mean_ptr + b)
    rr = _rsqrt(tl.math.div_rn(r, mu))
    cc = _rsqrt(c)
    return rr[:, None] * cc[None, :]


@triton.jit
@no_type_check
def _store_row_col(x, b, rb, pid_c, rows, cols, rmask, cmask, rowp_ptr, colp_ptr, n, m, n_rb,
                   n_cb):
    # Per-tile partial sums: rows -> (B, n, n_cb)[., ., pid_c]; columns -> (B, n_rb, m)[., rb, .]
    b64 = b.to(tl.int64)
    tl.store(rowp_ptr + (b64 * n + rows) * n_cb + pid_c, tl.sum(x, axis=1), mask=rmask)
    tl.store(colp_ptr + (b64 * n_rb + rb) * m + cols, tl.sum(x, axis=0), mask=cmask)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
@no_type_check
def _sq_sums_kernel(g_ptr, rowp_ptr, colp_ptr, eps, n, m, n_rb, n_cb,
                    BR: tl.constexpr, BC: tl.constexpr):
    pid_c = tl.program_id(0)
    b, rb, rows, cols, rmask, cmask, off, mask = _tile(pid_c, tl.program_id(1), n, m, n_rb,
                                                       BR, BC)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(mask, g * g + eps, 0.0)
    _store_row_col(x, b, rb, pid_c, rows, cols, rmask, cmask, rowp_ptr, colp_ptr, n, m, n_rb,
                   n_cb)


@triton.jit
@no_type_check
def _norm_kernel(g_ptr, row_ptr, col_ptr, mean_ptr, v_ptr, v_out_ptr, part_ptr,
                 d, omd, eps, n, m, n_rb, n_cb,
                 FACTORED: tl.constexpr, D_PTR: tl.constexpr, OMD_PTR: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr):
    # Per tile: sum of (g * rsqrt(V))^2, V factored, or full and updated here (V' stored).
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    b, _rb, rows, cols, rmask, cmask, off, mask = _tile(pid_c, pid_r, n, m, n_rb, BR, BC)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if FACTORED:
        u = _factored_inv(row_ptr, col_ptr, mean_ptr, b, rows, cols, rmask, cmask, n, m) * g
    else:
        v = tl.load(v_ptr + off, mask=mask, other=1.0)
        v = v * _scalar(d, D_PTR) + (g * g + eps) * _scalar(omd, OMD_PTR)
        tl.store(v_out_ptr + off, v, mask=mask)
        u = _rsqrt(v) * g
    s = tl.sum(tl.sum(tl.where(mask, u * u, 0.0), axis=1), axis=0)
    tl.store(part_ptr + pid_r.to(tl.int64) * n_cb + pid_c, s)


@triton.jit
@no_type_check
def _came_res_kernel(g_ptr, row_ptr, col_ptr, mean_ptr, m_ptr, m_out_ptr, rowp_ptr, colp_ptr,
                     clip, d1, omd1, eps2, n, m, n_rb, n_cb,
                     CLIP_PTR: tl.constexpr, D1_PTR: tl.constexpr, OMD1_PTR: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr):
    pid_c = tl.program_id(0)
    b, rb, rows, cols, rmask, cmask, off, mask = _tile(pid_c, tl.program_id(1), n, m, n_rb,
                                                       BR, BC)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    u = _factored_inv(row_ptr, col_ptr, mean_ptr, b, rows, cols, rmask, cmask, n, m) * g
    u = tl.math.div_rn(u, _scalar(clip, CLIP_PTR))
    mo = tl.load(m_ptr + off, mask=mask, other=0.0)
    mn = mo * _scalar(d1, D1_PTR) + u * _scalar(omd1, OMD1_PTR)
    tl.store(m_out_ptr + off, mn, mask=mask)
    r = u - mn
    x = tl.where(mask, r * r + eps2, 0.0)
    _store_row_col(x, b, rb, pid_c, rows, cols, rmask, cmask, rowp_ptr, colp_ptr, n, m, n_rb,
                   n_cb)


@triton.jit
@no_type_check
def _apply_kernel(x_ptr, p_ptr, out_ptr, m_ptr, m_out_ptr, row_ptr, col_ptr, mean_ptr, v_ptr,
                  clip, pre, post, dc, d1, omd1, n, m, n_rb,
                  KIND: tl.constexpr, HAS_CLIP: tl.constexpr, CLIP_PTR: tl.constexpr,
                  HAS_PRE: tl.constexpr, PRE_PTR: tl.constexpr,
                  HAS_POST: tl.constexpr, POST_PTR: tl.constexpr,
                  HAS_DECAY: tl.constexpr, DC_PTR: tl.constexpr,
                  MOMENTUM: tl.constexpr, D1_PTR: tl.constexpr, OMD1_PTR: tl.constexpr,
                  OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    # KIND: 0 no preconditioner, 1 factored, 2 full. OUT: 0 direction, 1 update, 2 param.
    pid_c = tl.program_id(0)
    b, _rb, rows, cols, rmask, cmask, off, mask = _tile(pid_c, tl.program_id(1), n, m, n_rb,
                                                       BR, BC)
    y = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if KIND == 1:
        y = _factored_inv(row_ptr, col_ptr, mean_ptr, b, rows, cols, rmask, cmask, n, m) * y
    if KIND == 2:
        v = tl.load(v_ptr + off, mask=mask, other=1.0)
        y = _rsqrt(v) * y
    if HAS_CLIP:
        y = tl.math.div_rn(y, _scalar(clip, CLIP_PTR))
    if HAS_PRE:
        y = y * _scalar(pre, PRE_PTR)
    if MOMENTUM:
        mo = tl.load(m_ptr + off, mask=mask, other=0.0)
        y = mo * _scalar(d1, D1_PTR) + y * _scalar(omd1, OMD1_PTR)
        tl.store(m_out_ptr + off, y, mask=mask)
    if HAS_POST:
        y = y * _scalar(post, POST_PTR)
    if OUT == 0:
        tl.store(out_ptr + off, y, mask=mask)
    else:
        p = tl.load(p_ptr + off, mask=mask, other=0.0).to(tl.float32)
        q = p
        if HAS_DECAY:
            q = p + p * _scalar(dc, DC_PTR)
        q = q - y
        if OUT == 1:
            tl.store(out_ptr + off, q - p, mask=mask)
        else:
            tl.store(out_ptr + off, q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=mask)


# --------------------------------------------------------------------------------------------
# wrappers (same signatures and results as the references)
# --------------------------------------------------------------------------------------------


def sq_row_col_sums(g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    g = g.contiguous()
    b, n, m = _view(g, True)
    br, bc, n_rb, n_cb, grid = _grid(b, n, m, "sq_row_col_sums")
    rowp = _alloc((b, n, n_cb), torch.float32, g.device)
    colp = _alloc((b, n_rb, m), torch.float32, g.device)
    _sq_sums_kernel[grid](g, rowp, colp, float(eps), n, m, n_rb, n_cb, BR=br, BC=bc)
    lead = tuple(g.shape[:-2])
    return rowp.sum(-1).reshape(lead + (n, 1)), colp.sum(1).reshape(lead + (1, m))


def scaled_norm(g: Tensor, factors: F.Factors) -> Tensor:
    g = g.contiguous()
    b, n, m = _view(g, True)
    br, bc, n_rb, n_cb, grid = _grid(b, n, m, "scaled_norm")
    row, col, mean = _factors_args(factors)
    part = _alloc((n_rb * b, n_cb), torch.float32, g.device)
    _norm_kernel[grid](g, row, col, mean, g, g, part, 0.0, 0.0, 0.0, n, m, n_rb, n_cb,
                       FACTORED=True, D_PTR=False, OMD_PTR=False, BR=br, BC=bc)
    return part.sum().sqrt()


def full_moment(g: Tensor, v: Tensor, decay: float | Tensor, eps: float) -> tuple[Tensor, Tensor]:
    g, v = g.contiguous(), v.to(torch.float32).contiguous()
    b, n, m = _view(g, False)
    br, bc, n_rb, n_cb, grid = _grid(b, n, m, "full_moment")
    (d, d_ptr), (omd, omd_ptr) = _ema_args(decay, g.device)
    v_out = _alloc(tuple(g.shape), torch.float32, g.device)
    part = _alloc((n_rb * b, n_cb), torch.float32, g.device)
    _norm_kernel[grid](g, v, v, v, v, v_out, part, d, omd, float(eps), n, m, n_rb, n_cb,
                       FACTORED=False, D_PTR=d_ptr, OMD_PTR=omd_ptr, BR=br, BC=bc)
    return v_out, part.sum().sqrt()


def came_residual(g: Tensor, factors: F.Factors, clip: Tensor, m_state: Tensor,
                  beta1: float | Tensor, eps2: float) -> tuple[Tensor, Tensor, Tensor]:
    g, mo = g.contiguous(), m_state.to(torch.float32).contiguous()
    b, n, m = _view(g, True)
    br, bc, n_rb, n_cb, grid = _grid(b, n, m, "came_residual")
    row, col, mean = _factors_args(factors)
    clip_v, clip_ptr = _sarg(clip, g.device)
    (d1, d1_ptr), (omd1, omd1_ptr) = _ema_args(beta1, g.device)
    m_out = _alloc(tuple(g.shape), torch.float32, g.device)
    rowp = _alloc((b, n, n_cb), torch.float32, g.device)
    colp = _alloc((b, n_rb, m), torch.float32, g.device)
    _came_res_kernel[grid](g, row, col, mean, mo, m_out, rowp, colp, clip_v, d1, omd1,
                           float(eps2), n, m, n_rb, n_cb, CLIP_PTR=clip_ptr, D1_PTR=d1_ptr,
                           OMD1_PTR=omd1_ptr, BR=br, BC=bc)
    lead = tuple(g.shape[:-2])
    return m_out, rowp.sum(-1).reshape(lead + (n, 1)), colp.sum(1).reshape(lead + (1, m))


def precond_apply(x: Tensor, p: Tensor | None, precond: F.Factors | Tensor | None, *,
                  clip=None, pre=None, momentum=None, beta1=None, post=None, decay=None,
                  out: str = "param") -> tuple[Tensor, Tensor | None]:
    dev = x.device
    x = x.contiguous()
    kind = 1 if isinstance(precond, F.Factors) else (2 if precond is not None else 0)
    b, n, m = _view(x, kind == 1)
    br, bc, n_rb, _n_cb, grid = _grid(b, n, m, "precond_apply")
    row = col = mean = v = x
    if kind == 1:
        row, col, mean = _factors_args(precond)
    elif kind == 2:
        v = precond.to(torch.float32).contiguous()
    mode = F.OUT_MODES.index(out)
    p_in = x if mode == 0 else p.contiguous()
    result = _alloc(tuple(x.shape), p.dtype if mode == 2 else torch.float32, dev)
    m_in = m_out = x
    d1 = omd1 = (0.0, False)
    if momentum is not None:
        m_in = momentum.to(torch.float32).contiguous()
        m_out = _alloc(tuple(x.shape), torch.float32, dev)
        d1, omd1 = _ema_args(beta1, dev)
    clip_a, pre_a, post_a = _sarg(clip, dev), _sarg(pre, dev), _sarg(post, dev)
    dc_a = _sarg(None if decay is None else -torch.as_tensor(decay, dtype=torch.float64), dev)
    _apply_kernel[grid](
        x, p_in, result, m_in, m_out, row, col, mean, v,
        clip_a[0], pre_a[0], post_a[0], dc_a[0], d1[0], omd1[0], n, m, n_rb,
        KIND=kind, HAS_CLIP=clip is not None, CLIP_PTR=clip_a[1],
        HAS_PRE=pre is not None, PRE_PTR=pre_a[1],
        HAS_POST=post is not None, POST_PTR=post_a[1],
        HAS_DECAY=decay is not None, DC_PTR=dc_a[1],
        MOMENTUM=momentum is not None, D1_PTR=d1[1], OMD1_PTR=omd1[1],
        OUT=mode, BR=br, BC=bc,
    )
    return result, (m_out if momentum is not None else None)
