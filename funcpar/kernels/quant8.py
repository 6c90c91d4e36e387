"""Blockwise 8-bit quantization and the fused 8-bit Adam step of GaLore's states: references,
Triton kernels, dispatch.

The format is :mod:`funcpar.optim.quant8`'s (Dettmers et al. 2022, arXiv 2110.02861): blocks of
``block_size`` consecutive elements (row-major), a float32 ``absmax`` per block and per element
the uint8 index of the code of a sorted 256-entry map nearest to ``x / absmax`` (a tie to the
lower index; an all-zero block maps to the code of 0). The references here are that module's
whole-tensor (unsharded) code; a sharded state (global blocks over ranks) stays in
:mod:`funcpar.optim.quant8`, which needs an all-reduce of the absmax between the two halves.

Kernels: one program quantizes ``ROWS`` blocks: the block's absmax is a row max of the tile in
registers, the quotient an IEEE division, the nearest code an 8-step binary search over the map
(1 KiB, cached) and one comparison of the two neighbours' distances: the same float32
operations as the reference, so codes and absmax are bit-identical. The fused Adam step
(:func:`adam8bit_step`) dequantizes ``m`` and ``v``, updates them with the gradient, writes the
Adam direction and requantizes both in one pass: per element 4 B of gradient read, 4 B of
direction written, 2 B of codes read and 2 B written (plus 16 B per block of absmax), against
the 26 B of dequantizing both states to float32, updating them and quantizing them again.
"""

from __future__ import annotations

from typing import NamedTuple, no_type_check

import torch
import torch.nn.functional as F
from jaxtyping import Float, Float32, UInt8
from torch import Tensor

from funcpar.kernels import _launch
from funcpar.kernels.dispatch import use_kernels

__all__ = [
    "Adam8bitScalars",
    "adam8bit_math",
    "adam8bit_reference",
    "adam8bit_step",
    "adam8bit_triton",
    "dequantize_blocks",
    "dequantize_reference",
    "dequantize_triton",
    "nearest_code",
    "quantize_blocks",
    "quantize_reference",
    "quantize_triton",
]

#: Blocks per program on a GPU: 4 blocks of 256 make 1024 elements per program.
ROWS = 4


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def nearest_code(
    scaled: Float32[Tensor, "*shape"], code: Float32[Tensor, " n_codes"]
) -> UInt8[Tensor, "*shape"]:
    """Index of the code nearest to each ``scaled`` value; a tie goes to the lower index.

    The left neighbour by binary search, then a float32 comparison of the two distances (the
    order of operations of bitsandbytes' CPU quantizer, so exact ties resolve alike).
    """
    last = code.numel() - 1
    left = (torch.searchsorted(code, scaled.contiguous(), right=True) - 1).clamp(0, last - 1)
    lo, hi = code[left], code[left + 1]
    go_right = (hi - scaled).abs() < (scaled - lo).abs()
    return (left + go_right.to(left.dtype)).to(torch.uint8)


def _blocks(x: Tensor, block_size: int) -> tuple[Tensor, int]:
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    pad = _num_blocks(n, block_size) * block_size - n
    return F.pad(flat, (0, pad)).view(-1, block_size), n


def quantize_reference(
    x: Float[Tensor, "*shape"], code: Float32[Tensor, " n_codes"], block_size: int
) -> tuple[UInt8[Tensor, "*shape"], Float32[Tensor, " n_blocks"]]:
    """``(codes, absmax)`` of the whole tensor ``x`` (rounded to float32 first)."""
    blocks, n = _blocks(x, block_size)
    absmax = blocks.abs().amax(dim=1)
    # |x| <= absmax makes the IEEE quotient lie in [-1, 1]; an all-zero block maps to 0.
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    scaled = torch.where(absmax[:, None] > 0, blocks / safe[:, None], torch.zeros_like(blocks))
    codes = nearest_code(scaled, code).reshape(-1)[:n].reshape(x.shape)
    return codes, absmax


def dequantize_reference(
    codes: UInt8[Tensor, "*shape"], absmax: Float32[Tensor, " n_blocks"],
    code: Float32[Tensor, " n_codes"], block_size: int, dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*shape"]:
    """``code[codes] * absmax`` per block (float32 product), as ``dtype``."""
    n = codes.numel()
    values, _ = _blocks(code[codes.reshape(-1).long()], block_size)
    out = (values * absmax[:, None]).reshape(-1)[:n]
    return out.reshape(codes.shape).to(dtype)


class Adam8bitScalars(NamedTuple):
    beta1: float
    beta2: float
    eps: Tensor | float
    bc2_sqrt: Tensor | float  # sqrt(1 - b2^t), used by the "bnb" direction
    variant: str  # "hf": m / (sqrt(v) + eps); "bnb": m / (sqrt(v) / bc2_sqrt + eps)


def adam8bit_math(
    m: Tensor, v: Tensor, g: Tensor, s: Adam8bitScalars
) -> tuple[Tensor, Tensor, Tensor]:
    """``(m', v', direction)``: GaLore's inner Adam on (dequantized) states, element-wise."""
    m = torch.add(m * s.beta1, g, alpha=1 - s.beta1)
    v = torch.addcmul(v * s.beta2, g, g, value=1 - s.beta2)
    if s.variant == "hf":
        return m, v, m / (v.sqrt() + s.eps)
    return m, v, m / (v.sqrt() / s.bc2_sqrt + s.eps)


Q = tuple[Tensor, Tensor]  # (codes, absmax)


def adam8bit_reference(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, block_size: int, s: Adam8bitScalars,
) -> tuple[Tensor, Q, Q]:
    """Dequantize (to ``g``'s dtype), :func:`adam8bit_math`, requantize:
    ``(direction, (m codes, absmax), (v codes, absmax))``."""
    m_f = dequantize_reference(*m, code_m, block_size, g.dtype)
    v_f = dequantize_reference(*v, code_v, block_size, g.dtype)
    m_f, v_f, direction = adam8bit_math(m_f, v_f, g, s)
    return (direction, quantize_reference(m_f, code_m, block_size),
            quantize_reference(v_f, code_v, block_size))


def _build():
    global tl, triton, nearest_code_jit, block_offsets_jit, max_combine
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check
    def max_combine(a, b):
        # Not tl.max: Triton's standard library is decorated when Triton is imported, so with
        # TRITON_INTERPRET=1 set later it would not run in the interpreter.
        return tl.maximum(a, b)

    @triton.jit
    @no_type_check
    def block_offsets_jit(n, n_blocks, block_size, ROWS: tl.constexpr, TILE: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, TILE)
        offs = rows[:, None].to(tl.int64) * block_size + cols[None, :]
        mask = (cols[None, :] < block_size) & (offs < n) & (rows[:, None] < n_blocks)
        return rows, offs, mask

    @triton.jit
    @no_type_check
    def nearest_code_jit(s, code):
        # count = #{k : code[k] <= s} capped at 255 by binary lifting over the sorted map, then
        # the left neighbour clamped to [0, 254] and the nearer of it and the next code.
        cnt = tl.full(s.shape, 0, tl.int32)  # tl.full: a builtin (tl.zeros is library)
        for i in tl.static_range(8):
            cand = cnt + (128 >> i)
            cnt = tl.where(tl.load(code + cand - 1) <= s, cand, cnt)
        left = tl.minimum(tl.maximum(cnt - 1, 0), 254)
        lo = tl.load(code + left)
        hi = tl.load(code + left + 1)
        go_right = tl.abs(hi - s) < tl.abs(s - lo)
        return (left + go_right.to(tl.int32)).to(tl.uint8)

    @triton.jit
    @no_type_check
    def quantize_kernel(x, codes, absmax, code, n, n_blocks, block_size, ROWS: tl.constexpr,
                        TILE: tl.constexpr):
        rows, offs, mask = block_offsets_jit(n, n_blocks, block_size, ROWS, TILE)
        xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        am = tl.reduce(tl.abs(xv), 1, max_combine)
        tl.store(absmax + rows, am, mask=rows < n_blocks)
        safe = tl.where(am > 0, am, 1.0)
        scaled = tl.where(am[:, None] > 0, tl.div_rn(xv, safe[:, None]), 0.0)
        tl.store(codes + offs, nearest_code_jit(scaled, code), mask=mask)

    @triton.jit
    @no_type_check
    def dequantize_kernel(codes, absmax, code, out, n, n_blocks, block_size, OUT: tl.constexpr,
                          ROWS: tl.constexpr, TILE: tl.constexpr):
        rows, offs, mask = block_offsets_jit(n, n_blocks, block_size, ROWS, TILE)
        c = tl.load(codes + offs, mask=mask, other=0).to(tl.int32)
        am = tl.load(absmax + rows, mask=rows < n_blocks, other=0.0)
        tl.store(out + offs, (tl.load(code + c) * am[:, None]).to(OUT), mask=mask)

    @triton.jit
    @no_type_check
    def adam8bit_kernel(g_ptr, mc, ma, vc, va, code_m, code_v, direction, mc_out, ma_out,
                        vc_out, va_out, scal, n, n_blocks, block_size, HF: tl.constexpr,
                        ROWS: tl.constexpr, TILE: tl.constexpr):
        rows, offs, mask = block_offsets_jit(n, n_blocks, block_size, ROWS, TILE)
        rmask = rows < n_blocks
        beta1 = tl.load(scal)
        c1 = tl.load(scal + 1)  # 1 - beta1
        beta2 = tl.load(scal + 2)
        c2 = tl.load(scal + 3)  # 1 - beta2
        eps = tl.load(scal + 4)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m = tl.load(code_m + tl.load(mc + offs, mask=mask, other=0).to(tl.int32))
        m = m * tl.load(ma + rows, mask=rmask, other=0.0)[:, None]
        v = tl.load(code_v + tl.load(vc + offs, mask=mask, other=0).to(tl.int32))
        v = v * tl.load(va + rows, mask=rmask, other=0.0)[:, None]
        m = tl.fma(g, c1, m * beta1)  # torch.add(m * b1, g, alpha=1 - b1)
        v = v * beta2 + (c2 * g) * g  # torch.addcmul(v * b2, g, g, value=1 - b2)
        if HF:
            d = tl.div_rn(m, tl.sqrt_rn(v) + eps)
        else:
            d = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), tl.load(scal + 5)) + eps)
        tl.store(direction + offs, d, mask=mask)
        # Padding lanes decoded code[0] * absmax: zero them so they cannot raise a block's max.
        m = tl.where(mask, m, 0.0)
        v = tl.where(mask, v, 0.0)
        am = tl.reduce(tl.abs(m), 1, max_combine)
        tl.store(ma_out + rows, am, mask=rmask)
        scaled = tl.where(am[:, None] > 0, tl.div_rn(m, tl.where(am > 0, am, 1.0)[:, None]), 0.0)
        tl.store(mc_out + offs, nearest_code_jit(scaled, code_m), mask=mask)
        av = tl.reduce(tl.abs(v), 1, max_combine)
        tl.store(va_out + rows, av, mask=rmask)
        scaled = tl.where(av[:, None] > 0, tl.div_rn(v, tl.where(av > 0, av, 1.0)[:, None]), 0.0)
        tl.store(vc_out + offs, nearest_code_jit(scaled, code_v), mask=mask)

    return quantize_kernel, dequantize_kernel, adam8bit_kernel


_kernels = _launch.lazy_kernels(_build)


def _grid(n: int, block_size: int, rows: int) -> tuple[int, int, int]:
    nb = _num_blocks(n, block_size)
    tile = 1 << max(0, (block_size - 1).bit_length())
    return nb, tile, -(-nb // rows)


def _rows(rows: int | None, device: torch.device) -> int:
    return rows or (ROWS if device.type == "cuda" else 1)


def quantize_triton(
    x: Float[Tensor, "*shape"], code: Float32[Tensor, " n_codes"], block_size: int, *,
    rows: int | None = None,
) -> tuple[UInt8[Tensor, "*shape"], Float32[Tensor, " n_blocks"]]:
    """:func:`quantize_reference` by the Triton kernel (a 256-entry map)."""
    x = x.contiguous()
    rows = _rows(rows, x.device)
    nb, tile, grid = _grid(x.numel(), block_size, rows)
    codes = _launch.new_output(x.shape, torch.uint8, x.device)
    absmax = _launch.new_output((nb,), torch.float32, x.device)
    if nb:
        code = _launch.to_device(code.float().contiguous(), x.device)
        _kernels()[0][(grid,)](x, codes, absmax, code, x.numel(), nb, block_size, ROWS=rows,
                               TILE=tile)
    return codes, absmax


def dequantize_triton(
    codes: UInt8[Tensor, "*shape"], absmax: Float32[Tensor, " n_blocks"],
    code: Float32[Tensor, " n_codes"], block_size: int, dtype: torch.dtype = torch.float32, *,
    rows: int | None = None,
) -> Float[Tensor, "*shape"]:
    """:func:`dequantize_reference` by the Triton kernel."""
    codes = codes.contiguous()
    rows = _rows(rows, codes.device)
    nb, tile, grid = _grid(codes.numel(), block_size, rows)
    out = _launch.new_output(codes.shape, dtype, codes.device)
    if nb:
        _kernels()[1][(grid,)](codes, absmax.contiguous(),
                               _launch.to_device(code.float().contiguous(), codes.device), out,
                               codes.numel(), nb, block_size, OUT=_launch.tl_dtype(dtype),
                               ROWS=rows, TILE=tile)
    return out


def adam8bit_triton(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, block_size: int, s: Adam8bitScalars,
    *, rows: int | None = None,
) -> tuple[Tensor, Q, Q]:
    """:func:`adam8bit_reference` by the fused Triton kernel (float32 ``g``)."""
    g = g.contiguous()
    device = g.device
    rows = _rows(rows, device)
    nb, tile, grid = _grid(g.numel(), block_size, rows)
    direction = _launch.new_output(g.shape, torch.float32, device)
    mc, vc = (_launch.new_output(g.shape, torch.uint8, device) for _ in range(2))
    ma, va = (_launch.new_output((nb,), torch.float32, device) for _ in range(2))
    if nb:
        scal = _launch.device_scalars(
            [s.beta1, 1 - s.beta1, s.beta2, 1 - s.beta2, s.eps, s.bc2_sqrt], device)
        _kernels()[2][(grid,)](
            g, m[0].contiguous(), m[1].contiguous(), v[0].contiguous(), v[1].contiguous(),
            _launch.to_device(code_m.float().contiguous(), device),
            _launch.to_device(code_v.float().contiguous(), device), direction, mc, ma, vc, va, scal,
            g.numel(), nb, block_size, HF=s.variant == "hf", ROWS=rows, TILE=tile)
    return direction, (mc, ma), (vc, va)


def _ok(code: Tensor, block_size: int, *tensors: Tensor) -> bool:
    # The kernels search a 256-entry map; a tile is the block padded to a power of two.
    return code.numel() == 256 and block_size <= 8192 and use_kernels(*tensors)


def quantize_blocks(
    x: Float[Tensor, "*shape"], code: Float32[Tensor, " n_codes"], block_size: int
) -> tuple[UInt8[Tensor, "*shape"], Float32[Tensor, " n_blocks"]]:
    """Quantize the whole tensor ``x``: the kernel when :func:`funcpar.kernels.use_kernels`
    says so (a 256-entry map, a kernel dtype), else the reference."""
    if _launch.kernel_dtype_ok(x) and _ok(code, block_size, x):
        return quantize_triton(x, code, block_size)
    return quantize_reference(x, code, block_size)


def dequantize_blocks(
    codes: UInt8[Tensor, "*shape"], absmax: Float32[Tensor, " n_blocks"],
    code: Float32[Tensor, " n_codes"], block_size: int, dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*shape"]:
    """Dequantize a whole tensor: the kernel or the reference, as :func:`quantize_blocks`."""
    if dtype in _launch.KERNEL_DTYPES and _ok(code, block_size, codes, absmax):
        return dequantize_triton(codes, absmax, code, block_size, dtype)
    return dequantize_reference(codes, absmax, code, block_size, dtype)


def adam8bit_step(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, block_size: int, s: Adam8bitScalars,
) -> tuple[Tensor, Q, Q]:
    """The fused kernel for a float32 gradient of at least one dimension when
    :func:`funcpar.kernels.use_kernels` says so, else the reference."""
    # (A 0-d state meets the 0-d float64 eps in torch's float64: the reference keeps it.)
    if (g.dtype == torch.float32 and g.dim() > 0 and code_v.numel() == 256
            and _ok(code_m, block_size, g, m[0], m[1], v[0], v[1])):
        return adam8bit_triton(g, m, v, code_m, code_v, block_size, s)
    return adam8bit_reference(g, m, v, code_m, code_v, block_size, s)
