"""Blockwise 8-bit quantization and the fused 8-bit Adam step of GaLore's states: references,
Triton kernels, dispatch.

The format is :mod:`funcpar.optim.quant8`'s (Dettmers et al. 2022, arXiv 2110.02861): blocks of
``block_size`` consecutive elements (row-major), a float32 ``absmax`` per block and per element
the uint8 index of the code of a sorted 256-entry map nearest to ``x / absmax`` (a tie to the
lower index; an all-zero block maps to the code of 0). The references here are that module's
code. A *sharded* state (this rank's part of a tensor whose blocks are the whole tensor's) is
described by a per-element block index (:func:`local_absmax_reference` and friends) or, for the
kernels, by its :class:`Segments` (runs of consecutive local elements lying in one global block);
its Adam step is two passes around the absmax all-reduce that :mod:`funcpar.optim.quant8`
issues (:func:`adam8bit_absmax_triton`, :func:`adam8bit_requantize_triton`, references
beside them).

The references on CPU: the nearest code of a quotient (in ``[-1, 1]`` by construction) is a
lookup of its top 16 bits plus at most one comparison (:func:`_nearest_unit`, tables built
from the binary search itself), and the gathers are ``index_select`` s with int32 indices. The
8-bit Adam step, when nothing must be differentiated, writes its own temporaries in place and
goes over a large leaf in cache-sized pieces of whole blocks (:data:`PIECE`). All of it is the
same operations on the same float32 values: the same bits as the out-of-place code (tested).

Kernels: one program quantizes ``ROWS`` blocks: the block's absmax is a row max of the tile in
registers, the quotient an IEEE division, the nearest code an 8-step binary search over the map
(1 KiB, cached) and one comparison of the two neighbours' distances: the same float32
operations as the reference, so codes and absmax are bit-identical. The fused Adam step
(:func:`adam8bit_step`) dequantizes ``m`` and ``v``, updates them with the gradient, writes the
Adam direction and requantizes both in one pass: per element 4 B of gradient read, 4 B of
direction written, 2 B of codes read and 2 B written (plus 16 B per block of absmax), against
the 26 B of dequantizing both states to float32, updating them and quantizing them again.

Sharded states: a global block may be cut over ranks, so no rank knows its absmax before the
all-reduce (max) over the ranks holding a part of it. Pass 1 (:func:`adam8bit_absmax_triton`)
dequantizes, updates ``m`` and ``v``, writes the direction and the max of ``|m'|``, ``|v'|`` over
each segment (the segment maxima are folded into per-block maxima by a ``scatter_reduce``: max is
exact, so the order does not matter); pass 2 (:func:`adam8bit_requantize_triton`), after the
all-reduce, recomputes ``m'`` and ``v'`` from the same inputs (the same operations: the same
bits) and writes their codes against the global absmax. 18 B/param (g and codes read twice,
direction written, codes written) against 12 for the one-pass whole step: recomputing is cheaper
than writing and re-reading ``m'`` and ``v'`` in float32 (28 B).
"""

from __future__ import annotations

from typing import NamedTuple, no_type_check

import torch
import torch.nn.functional as F
from jaxtyping import Float, Float32, UInt8
from torch import Tensor

from funcpar.kernels import _launch
from funcpar.kernels.dispatch import fast_path_ok, inplace_allowed, use_kernels

__all__ = [
    "Adam8bitScalars",
    "Segments",
    "adam8bit_absmax_reference",
    "adam8bit_absmax_triton",
    "adam8bit_math",
    "adam8bit_reference",
    "adam8bit_requantize_reference",
    "adam8bit_requantize_triton",
    "adam8bit_sharded_uses_kernel",
    "adam8bit_step",
    "adam8bit_triton",
    "block_segments",
    "dequantize_blocks",
    "dequantize_global_reference",
    "dequantize_reference",
    "dequantize_triton",
    "local_absmax_reference",
    "nearest_code",
    "quantize_blocks",
    "quantize_global_reference",
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

    The definition is :func:`_nearest_search`; on CPU, for values in ``[-1, 1]`` (and NaN),
    :func:`_nearest_unit`'s table gives the same codes in a few cheap passes.
    """
    if (scaled.numel() and _table_ok(scaled, code)
            and bool(scaled.abs().amax() <= 1)):  # NaN, inf, |x| > 1: the search
        return _nearest_unit(scaled, code)
    return _nearest_search(scaled, code)


def _nearest_search(scaled: Tensor, code: Tensor) -> Tensor:
    """The nearest code by definition: the left neighbour by binary search, then a float32
    comparison of the two distances (the order of operations of bitsandbytes' CPU quantizer,
    so exact ties resolve alike)."""
    last = code.numel() - 1
    left = (torch.searchsorted(code, scaled.contiguous(), right=True) - 1).clamp(0, last - 1)
    lo, hi = _gather(code, left), _gather(code, left + 1)
    go_right = (hi - scaled).abs() < (scaled - lo).abs()
    return (left + go_right.to(left.dtype)).to(torch.uint8)


def _gather(src: Tensor, index: Tensor) -> Tensor:
    """``src[index]`` for a 1-D ``src`` (the same values), by ``index_select``: on CPU an
    order of magnitude faster than advanced indexing over a leaf-sized index."""
    return torch.index_select(src, 0, index.reshape(-1)).view(index.shape)


def _table_ok(x: Tensor, code: Tensor) -> bool:
    # CUDA runs the kernels; inside a torch.func transform or torch.compile's tracing the
    # search (no data-dependent tables there).
    return (x.dtype == torch.float32 and code.dtype == torch.float32 and code.numel() <= 256
            and x.device.type == "cpu" and code.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and torch._C._functorch.maybe_current_level() is None)


# The tables of _nearest_unit per code map, by value (optimizers rebuilt every step by
# inject_hyperparams make new map tensors); None: a map the tables cannot describe.
_tables: dict[bytes, tuple[Tensor, Tensor] | None] = {}


def _float_key(bits: Tensor) -> Tensor:
    """An int64 key of float32 bit patterns (int64 holding the signed int32) in the order of
    their values (-0.0 just below +0.0); NaNs excluded."""
    return torch.where(bits >= 0, bits, -(bits + 2**31) - 1)


def _key_float(key: Tensor) -> Tensor:
    bits = torch.where(key >= 0, key, -(key + 1) - 2**31)
    return bits.to(torch.int32).view(torch.float32)


def _unit_table(code: Tensor) -> tuple[Tensor, Tensor] | None:
    """Per bucket of the 2^16 float32 buckets sharing their top 16 bits (``(bits >> 16) +
    32768``): the nearest code of its least value (uint8) and the least value of the bucket
    whose nearest code is one more (NaN where none), over the buckets of ``[-1, 1]``; elsewhere
    the code of NaN and no step. Built from :func:`_nearest_search` itself.

    On ``[-1, 1]`` (beyond the ends, a little past +-1) the nearest code is a nondecreasing
    function of the value: between two neighbours ``lo <= x < hi`` the float32 distances
    ``hi - x`` and ``x - lo`` are monotone in ``x`` (rounding is), so it steps from ``lo``'s
    index to ``hi``'s once. (Far outside it is not: for ``x >= 2**24`` both distances round
    alike by parity.) A bucket is an interval of values, so its codes are its least value's
    plus at most one step, found by binary search over its 2^16 members: when a bucket holds
    two steps (not so for the dynamic maps: a bucket spans 2^-7 of its magnitude, their codes
    are farther apart) the tables are None and the search runs."""
    key = code.numpy().tobytes()
    if key in _tables:
        return _tables[key]
    if len(_tables) >= 8:  # a handful of maps in any run: bound it all the same
        _tables.pop(next(iter(_tables)))
    top = torch.arange(-32768, 32768, dtype=torch.int64)
    ends = (_float_key(top << 16), _float_key((top << 16) + 0xFFFF))
    low, high = torch.minimum(*ends), torch.maximum(*ends)

    def codes(k: Tensor) -> Tensor:
        return _nearest_search(_key_float(k), code).long()

    # Buckets of values up to 1.0078 in magnitude: exponent and top mantissa bits <= 1.0's.
    unit = (top & 0x7FFF) <= 0x3F80
    c_low = codes(low)
    steps = codes(high) - c_low
    hit: tuple[Tensor, Tensor] | None = None
    if bool(((steps >= 0) & (steps <= 1))[unit].all()):
        at = (unit & (steps == 1)).nonzero().squeeze(1)
        lo, hi, c = low[at], high[at], c_low[at]
        for _ in range(16):  # the least member whose code is c + 1
            mid = (lo + hi) // 2
            up = codes(mid) > c
            lo, hi = torch.where(up, lo, mid), torch.where(up, mid, hi)
        nan = float("nan")
        table = torch.where(unit, c_low, _nearest_search(torch.tensor([nan]), code).long())
        step_at = torch.full((65536,), nan).index_put_((at,), _key_float(hi))
        hit = (table.to(torch.uint8), step_at)
    _tables[key] = hit
    return hit


def _nearest_unit(scaled: Tensor, code: Tensor) -> Tensor:
    """:func:`nearest_code` of values in ``[-1, 1]`` or NaN (any other value: wrong codes),
    by the bucket of the top 16 bits: its code, plus one past its step. Four passes over
    ``scaled`` (two of them 1-byte) where the search makes a dozen; the same codes
    (tests/test_quant8.py). Outside :func:`_table_ok`'s cases the search."""
    tables = _unit_table(code) if _table_ok(scaled, code) else None
    if tables is None:
        return _nearest_search(scaled, code)
    table, step_at = tables
    x = scaled.reshape(-1)
    bucket = torch.bitwise_right_shift(x.view(torch.int32), 16).add_(32768)
    out = torch.index_select(table, 0, bucket)
    return out.add_(x >= torch.index_select(step_at, 0, bucket)).view(scaled.shape)


def _blocks(x: Tensor, block_size: int) -> tuple[Tensor, int]:
    """``x`` (float32) as rows of ``block_size``, the last padded with zeros (a copy only
    then), and its number of elements."""
    flat = x.reshape(-1)
    flat = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
    n = flat.numel()
    pad = _num_blocks(n, block_size) * block_size - n
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block_size), n


def _own(*tensors: object) -> bool:
    """Whether a step's own temporaries may be written in place (the same operations, the
    same bits): not when it must be differentiable, nor under a torch.func transform or
    torch.compile's tracing."""
    return fast_path_ok(*tensors) and not torch.compiler.is_compiling()


def quantize_reference(
    x: Float[Tensor, "*shape"], code: Float32[Tensor, " n_codes"], block_size: int, *,
    own: bool = False,
) -> tuple[UInt8[Tensor, "*shape"], Float32[Tensor, " n_blocks"]]:
    """``(codes, absmax)`` of the whole tensor ``x`` (rounded to float32 first). ``own``: ``x``
    is the caller's scratch, which the quotients may overwrite (:func:`_own` holds)."""
    blocks, n = _blocks(x, block_size)
    absmax = blocks.abs().amax(dim=1)
    # |x| <= absmax makes the IEEE quotient lie in [-1, 1] (or be NaN: inf / inf), the domain
    # of _nearest_unit; an all-zero (or NaN) block maps to 0.
    ok = absmax > 0
    safe = torch.where(ok, absmax, 1.0).unsqueeze(1)
    if own:
        scaled = blocks.div_(safe)
        if not bool(ok.all()):
            scaled.masked_fill_(~ok.unsqueeze(1), 0.0)
    else:
        scaled = torch.where(ok.unsqueeze(1), blocks / safe, torch.zeros_like(blocks))
    codes = _nearest_unit(scaled, code)
    return (codes if codes.numel() == n else codes.view(-1)[:n]).view(x.shape), absmax


def dequantize_reference(
    codes: UInt8[Tensor, "*shape"], absmax: Float32[Tensor, " n_blocks"],
    code: Float32[Tensor, " n_codes"], block_size: int, dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*shape"]:
    """``code[codes] * absmax`` per block (float32 product), as ``dtype``."""
    n = codes.numel()
    values, _ = _blocks(torch.index_select(code, 0, codes.reshape(-1).to(torch.int32)),
                        block_size)
    # (values is this function's own: the product may overwrite it.)
    scale = absmax.unsqueeze(1)
    out = values.mul_(scale) if _own(codes, absmax) else values * scale
    out = (out if out.numel() == n else out.view(-1)[:n]).view(codes.shape)
    return out if out.dtype == dtype else out.to(dtype)


class Adam8bitScalars(NamedTuple):
    beta1: float
    beta2: float
    eps: Tensor | float
    bc2_sqrt: Tensor | float  # sqrt(1 - b2^t), used by the "bnb" direction
    variant: str  # "hf": m / (sqrt(v) + eps); "bnb": m / (sqrt(v) / bc2_sqrt + eps)


def adam8bit_math(
    m: Tensor, v: Tensor, g: Tensor, s: Adam8bitScalars, *, own: bool = False,
    keep_moments: bool = False, scratch: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(m', v', direction)``: GaLore's inner Adam on (dequantized) states, element-wise.

    ``own``: the step is not differentiated and ``m``, ``v`` have ``g``'s shape and dtype with
    at least one dim (a 0-d state meets the 0-d float64 hyperparameters in float64): the same
    operations in place on buffers, the same bits. The moments are then overwritten, unless
    ``keep_moments`` (new moments: the first operation of each writes a fresh tensor), and the
    direction goes into ``scratch`` when given (a buffer of ``g``'s shape the caller no longer
    reads: the step's own projected gradient, read for the last time by the moments)."""
    if not own:
        m = torch.add(m * s.beta1, g, alpha=1 - s.beta1)
        v = torch.addcmul(v * s.beta2, g, g, value=1 - s.beta2)
        if s.variant == "hf":
            return m, v, m / (v.sqrt() + s.eps)
        return m, v, m / (v.sqrt() / s.bc2_sqrt + s.eps)
    m = (torch.mul(m, s.beta1) if keep_moments else m.mul_(s.beta1)).add_(g, alpha=1 - s.beta1)
    v = (torch.mul(v, s.beta2) if keep_moments else v.mul_(s.beta2)).addcmul_(
        g, g, value=1 - s.beta2)
    den = v.sqrt() if scratch is None else torch.sqrt(v, out=scratch)
    if s.variant != "hf":
        den.div_(s.bc2_sqrt)
    return m, v, torch.div(m, den.add_(s.eps), out=den)


Q = tuple[Tensor, Tensor]  # (codes, absmax)


#: Elements per piece of the in-place CPU step (whole blocks): its temporaries, 1 MiB of float32
#: each, are reused by the allocator from piece to piece and stay in a core's cache, where
#: leaf-sized ones page-fault in fresh memory on every step.
PIECE = 1 << 18


def adam8bit_reference(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, block_size: int, s: Adam8bitScalars,
) -> tuple[Tensor, Q, Q]:
    """Dequantize (to ``g``'s dtype), :func:`adam8bit_math`, requantize:
    ``(direction, (m codes, absmax), (v codes, absmax))``.

    When :func:`_own` allows, the dequantized states are this step's to overwrite (moments,
    quotients) and a large leaf goes in pieces of whole blocks (:data:`PIECE`) written into its
    outputs: inside :func:`~funcpar.kernels.inplace.inplace_updates`, the state's own codes and
    absmax (a piece's are read before they are written). Blockwise and element-wise
    operations: the same bits."""
    own = (g.dim() > 0 and m[0].shape == g.shape == v[0].shape
           and _own(g, *m, *v, s.eps, s.bc2_sqrt))
    n = g.numel()
    rows = max(1, PIECE // block_size)
    if not own or _num_blocks(n, block_size) <= rows:
        direction, mq, vq = _adam8bit_blocks(g, m, v, code_m, code_v, block_size, s, own)
        mine, new = (*m, *v), (*mq, *vq)
        if own and inplace_allowed() and all(
                a.is_contiguous() and a.shape == b.shape and a.dtype == b.dtype
                for a, b in zip(mine, new)):
            # Donated: the state's own codes and absmax take the new ones (one multi-tensor
            # copy, the one the step's donation would make).
            torch._foreach_copy_(list(mine), list(new))
            return direction, m, v
        return direction, mq, vq
    states = (m[0], m[1], v[0], v[1])
    if not (inplace_allowed() and all(t.is_contiguous() for t in states)):
        states = tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                       for t in states)
    direction = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    ins = (g.reshape(-1), m[0].reshape(-1), m[1], v[0].reshape(-1), v[1])
    outs = (direction.view(-1), *(t.view(-1) for t in states))
    for r in range(0, _num_blocks(n, block_size), rows):
        e, b = slice(r * block_size, (r + rows) * block_size), slice(r, r + rows)
        at = (e, e, b, e, b)
        gp, mc, ma, vc, va = (t[i] for t, i in zip(ins, at))
        d, mq, vq = _adam8bit_blocks(gp, (mc, ma), (vc, va), code_m, code_v, block_size, s, True)
        for out, i, x in zip(outs, at, (d, *mq, *vq)):
            out[i] = x
    return direction, (states[0], states[1]), (states[2], states[3])


def _adam8bit_blocks(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, block_size: int, s: Adam8bitScalars,
    own: bool,
) -> tuple[Tensor, Q, Q]:
    m_f = dequantize_reference(*m, code_m, block_size, g.dtype)
    v_f = dequantize_reference(*v, code_v, block_size, g.dtype)
    m_f, v_f, direction = adam8bit_math(m_f, v_f, g, s, own=own)
    return (direction, quantize_reference(m_f, code_m, block_size, own=own),
            quantize_reference(v_f, code_v, block_size, own=own))


# --------------------------------------------------------------------------------------------
# Sharded states: this rank's elements in the whole tensor's blocks
# --------------------------------------------------------------------------------------------


def local_absmax_reference(
    x: Float[Tensor, "*shape"], index: Tensor, n_blocks: int
) -> Float32[Tensor, " n_blocks"]:
    """Per block of the whole tensor, the max of ``|x|`` over this rank's elements of it (0 for
    a block it holds none of); ``index[i]`` is the global block of element ``i`` (flat,
    row-major). The all-reduce (max) over the ranks completes it."""
    mags = x.reshape(-1).to(torch.float32).abs()
    local = torch.zeros(n_blocks, dtype=torch.float32, device=x.device)
    return local.scatter_reduce(0, index, mags, "amax", include_self=True)


def quantize_global_reference(
    x: Float[Tensor, "*shape"], absmax: Float32[Tensor, " n_blocks"], index: Tensor,
    code: Float32[Tensor, " n_codes"],
) -> UInt8[Tensor, "*shape"]:
    """Codes of this rank's elements against the whole tensor's (all-reduced) ``absmax``."""
    mine = _gather(absmax, index)
    safe = torch.where(mine > 0, mine, torch.ones_like(mine))
    scaled = torch.where(mine > 0, x.reshape(-1).to(torch.float32) / safe,
                         torch.zeros_like(mine))
    return nearest_code(scaled, code).reshape(x.shape)


def dequantize_global_reference(
    codes: UInt8[Tensor, "*shape"], absmax: Float32[Tensor, " n_blocks"], index: Tensor,
    code: Float32[Tensor, " n_codes"], dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*shape"]:
    """``code[codes] * absmax[block]`` (float32 product) for this rank's elements, as ``dtype``."""
    out = _gather(code, codes.reshape(-1).long()) * _gather(absmax, index)
    return out.reshape(codes.shape).to(dtype)


class Segments(NamedTuple):
    """A shard's elements as maximal runs of consecutive local elements (flat, row-major) that
    lie in one block of the whole tensor: what the sharded kernels iterate over (a program
    handles whole segments, so a segment's max is a row max in registers)."""

    start: Tensor  # int64 (n_segments,): first local element
    length: Tensor  # int32 (n_segments,): at most block_size
    block: Tensor  # int64 (n_segments,): the global block
    max_length: int
    n_blocks: int  # the whole tensor's number of blocks


def block_segments(index: Tensor, n_blocks: int) -> Segments:
    """The :class:`Segments` of a shard whose element ``i`` lies in global block ``index[i]``.

    A whole tensor gives its blocks; a row-split one whole blocks but at the cut; a column-split
    one one segment per (row, block) piece."""
    index = index.reshape(-1)
    n = index.numel()
    if n == 0:
        empty = index.new_zeros(0)
        return Segments(empty, empty.to(torch.int32), empty, 0, n_blocks)
    starts = torch.ones(n, dtype=torch.bool, device=index.device)
    starts[1:] = index[1:] != index[:-1]
    start = starts.nonzero().reshape(-1)
    length = torch.diff(start, append=start.new_tensor([n]))
    return Segments(start, length.to(torch.int32), index[start].contiguous(),
                    int(length.max()), n_blocks)


def _segment_index(segs: Segments) -> Tensor:
    return torch.repeat_interleave(segs.block, segs.length.long())


def adam8bit_absmax_reference(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, segs: Segments, s: Adam8bitScalars,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pass 1 of the sharded step: ``(direction, local absmax of m', local absmax of v')``;
    ``m``, ``v``: this rank's codes with the whole tensor's absmax."""
    index = _segment_index(segs)
    m_f = dequantize_global_reference(m[0], m[1], index, code_m, g.dtype)
    v_f = dequantize_global_reference(v[0], v[1], index, code_v, g.dtype)
    m_f, v_f, direction = adam8bit_math(m_f, v_f, g, s)
    return (direction, local_absmax_reference(m_f, index, segs.n_blocks),
            local_absmax_reference(v_f, index, segs.n_blocks))


def adam8bit_requantize_reference(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, segs: Segments, s: Adam8bitScalars,
    absmax_m: Tensor, absmax_v: Tensor,
) -> tuple[Tensor, Tensor]:
    """Pass 2: ``m'``, ``v'`` recomputed from the same inputs, coded against the whole tensor's
    new ``absmax_m`` / ``absmax_v`` (pass 1's, all-reduced): ``(m codes, v codes)``."""
    index = _segment_index(segs)
    m_f = dequantize_global_reference(m[0], m[1], index, code_m, g.dtype)
    v_f = dequantize_global_reference(v[0], v[1], index, code_v, g.dtype)
    m_f, v_f, _ = adam8bit_math(m_f, v_f, g, s)
    return (quantize_global_reference(m_f, absmax_m, index, code_m),
            quantize_global_reference(v_f, absmax_v, index, code_v))


def _build():
    global tl, triton, nearest_code_jit, block_offsets_jit, max_combine, adam8bit_moments_jit
    global adam8bit_direction_jit, requantize_jit, segment_moments_jit
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
    def adam8bit_moments_jit(g, mc, ma_row, vc, va_row, code_m, code_v, scal, offs, mask):
        # Dequantize (code * absmax in float32) and update both moments; padding lanes read
        # code[0] * absmax, so they are zeroed: they cannot raise a block's max.
        beta1 = tl.load(scal)
        c1 = tl.load(scal + 1)  # 1 - beta1
        beta2 = tl.load(scal + 2)
        c2 = tl.load(scal + 3)  # 1 - beta2
        m = tl.load(code_m + tl.load(mc + offs, mask=mask, other=0).to(tl.int32))
        m = m * ma_row[:, None]
        v = tl.load(code_v + tl.load(vc + offs, mask=mask, other=0).to(tl.int32))
        v = v * va_row[:, None]
        m = tl.fma(g, c1, m * beta1)  # torch.add(m * b1, g, alpha=1 - b1)
        v = v * beta2 + (c2 * g) * g  # torch.addcmul(v * b2, g, g, value=1 - b2)
        return tl.where(mask, m, 0.0), tl.where(mask, v, 0.0)

    @triton.jit
    @no_type_check
    def adam8bit_direction_jit(m, v, scal, HF: tl.constexpr):
        eps = tl.load(scal + 4)
        if HF:
            d = tl.div_rn(m, tl.sqrt_rn(v) + eps)
        else:
            d = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), tl.load(scal + 5)) + eps)
        return d

    @triton.jit
    @no_type_check
    def requantize_jit(x, am, code):
        # x / absmax of its block (IEEE division; 0 for an all-zero block), nearest code.
        scaled = tl.where(am[:, None] > 0, tl.div_rn(x, tl.where(am > 0, am, 1.0)[:, None]), 0.0)
        return nearest_code_jit(scaled, code)

    @triton.jit
    @no_type_check
    def adam8bit_kernel(g_ptr, mc, ma, vc, va, code_m, code_v, direction, mc_out, ma_out,
                        vc_out, va_out, scal, n, n_blocks, block_size, HF: tl.constexpr,
                        ROWS: tl.constexpr, TILE: tl.constexpr):
        rows, offs, mask = block_offsets_jit(n, n_blocks, block_size, ROWS, TILE)
        rmask = rows < n_blocks
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m, v = adam8bit_moments_jit(g, mc, tl.load(ma + rows, mask=rmask, other=0.0), vc,
                                    tl.load(va + rows, mask=rmask, other=0.0), code_m, code_v,
                                    scal, offs, mask)
        tl.store(direction + offs, adam8bit_direction_jit(m, v, scal, HF), mask=mask)
        am = tl.reduce(tl.abs(m), 1, max_combine)
        tl.store(ma_out + rows, am, mask=rmask)
        tl.store(mc_out + offs, requantize_jit(m, am, code_m), mask=mask)
        av = tl.reduce(tl.abs(v), 1, max_combine)
        tl.store(va_out + rows, av, mask=rmask)
        tl.store(vc_out + offs, requantize_jit(v, av, code_v), mask=mask)

    @triton.jit
    @no_type_check
    def segment_moments_jit(g_ptr, mc, ma, vc, va, code_m, code_v, seg_start, seg_len,
                            seg_block, scal, n_seg, ROWS: tl.constexpr, TILE: tl.constexpr):
        # ROWS segments per program, one per row of the tile (a segment's elements are
        # consecutive local elements of one global block, whose old absmax scales the row);
        # both passes start here, so pass 2 recomputes pass 1's moments bit for bit.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_seg
        start = tl.load(seg_start + rows, mask=rmask, other=0)
        length = tl.load(seg_len + rows, mask=rmask, other=0)
        blk = tl.load(seg_block + rows, mask=rmask, other=0)
        cols = tl.arange(0, TILE)
        offs = start[:, None] + cols[None, :]
        mask = (cols[None, :] < length[:, None]) & rmask[:, None]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m, v = adam8bit_moments_jit(g, mc, tl.load(ma + blk, mask=rmask, other=0.0), vc,
                                    tl.load(va + blk, mask=rmask, other=0.0), code_m, code_v,
                                    scal, offs, mask)
        return rows, rmask, blk, offs, mask, m, v

    @triton.jit
    @no_type_check
    def adam8bit_absmax_kernel(g_ptr, mc, ma, vc, va, code_m, code_v, direction, seg_m, seg_v,
                               seg_start, seg_len, seg_block, scal, n_seg, HF: tl.constexpr,
                               ROWS: tl.constexpr, TILE: tl.constexpr):
        rows, rmask, _blk, offs, mask, m, v = segment_moments_jit(
            g_ptr, mc, ma, vc, va, code_m, code_v, seg_start, seg_len, seg_block, scal, n_seg,
            ROWS, TILE)
        tl.store(direction + offs, adam8bit_direction_jit(m, v, scal, HF), mask=mask)
        tl.store(seg_m + rows, tl.reduce(tl.abs(m), 1, max_combine), mask=rmask)
        tl.store(seg_v + rows, tl.reduce(tl.abs(v), 1, max_combine), mask=rmask)

    @triton.jit
    @no_type_check
    def adam8bit_requantize_kernel(g_ptr, mc, ma, vc, va, code_m, code_v, ma_new, va_new,
                                   mc_out, vc_out, seg_start, seg_len, seg_block, scal, n_seg,
                                   ROWS: tl.constexpr, TILE: tl.constexpr):
        _rows, rmask, blk, offs, mask, m, v = segment_moments_jit(
            g_ptr, mc, ma, vc, va, code_m, code_v, seg_start, seg_len, seg_block, scal, n_seg,
            ROWS, TILE)
        am = tl.load(ma_new + blk, mask=rmask, other=0.0)
        tl.store(mc_out + offs, requantize_jit(m, am, code_m), mask=mask)
        av = tl.load(va_new + blk, mask=rmask, other=0.0)
        tl.store(vc_out + offs, requantize_jit(v, av, code_v), mask=mask)

    return (quantize_kernel, dequantize_kernel, adam8bit_kernel, adam8bit_absmax_kernel,
            adam8bit_requantize_kernel)


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
        scal = _adam_scalars(s, device)
        _kernels()[2][(grid,)](
            g, m[0].contiguous(), m[1].contiguous(), v[0].contiguous(), v[1].contiguous(),
            _launch.to_device(code_m.float().contiguous(), device),
            _launch.to_device(code_v.float().contiguous(), device), direction, mc, ma, vc, va, scal,
            g.numel(), nb, block_size, HF=s.variant == "hf", ROWS=rows, TILE=tile)
    return direction, (mc, ma), (vc, va)


def _segment_grid(segs: Segments, rows: int | None, device: torch.device) -> tuple[int, int, int]:
    # The tile is the longest segment padded to a power of two; on a GPU a program takes
    # about 1024 elements (more rows when segments are short, e.g. column-split shards).
    n_seg = segs.start.numel()
    tile = 1 << max(0, (max(segs.max_length, 1) - 1).bit_length())
    if rows is None:
        rows = max(1, 1024 // tile) if device.type == "cuda" else 1
    return n_seg, tile, rows


def _segment_args(segs: Segments, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    return (_launch.to_device(segs.start.contiguous(), device),
            _launch.to_device(segs.length.contiguous(), device),
            _launch.to_device(segs.block.contiguous(), device))


def _adam_scalars(s: Adam8bitScalars, device: torch.device) -> Tensor:
    return _launch.device_scalars(
        [s.beta1, 1 - s.beta1, s.beta2, 1 - s.beta2, s.eps, s.bc2_sqrt], device)


def adam8bit_absmax_triton(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, segs: Segments, s: Adam8bitScalars,
    *, rows: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`adam8bit_absmax_reference` by a Triton kernel (float32 ``g``): the direction and
    each segment's max, folded into per-block maxima here (``scatter_reduce``, exact)."""
    g = g.contiguous()
    device = g.device
    n_seg, tile, rows = _segment_grid(segs, rows, device)
    direction = _launch.new_output(g.shape, torch.float32, device)
    seg_m, seg_v = (_launch.new_output((n_seg,), torch.float32, device) for _ in range(2))
    if n_seg:
        _launch.launch(
            _kernels()[3], (-(-n_seg // rows),), g, m[0].contiguous(), m[1].contiguous(),
            v[0].contiguous(), v[1].contiguous(),
            _launch.to_device(code_m.float().contiguous(), device),
            _launch.to_device(code_v.float().contiguous(), device), direction, seg_m, seg_v,
            *_segment_args(segs, device), _adam_scalars(s, device), n_seg,
            HF=s.variant == "hf", ROWS=rows, TILE=tile)
    block = _launch.to_device(segs.block, device)
    zeros = torch.zeros(segs.n_blocks, dtype=torch.float32, device=device)
    return (direction, zeros.scatter_reduce(0, block, seg_m, "amax", include_self=True),
            zeros.scatter_reduce(0, block, seg_v, "amax", include_self=True))


def adam8bit_requantize_triton(
    g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor, segs: Segments, s: Adam8bitScalars,
    absmax_m: Tensor, absmax_v: Tensor, *, rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`adam8bit_requantize_reference` by a Triton kernel (float32 ``g``)."""
    g = g.contiguous()
    device = g.device
    n_seg, tile, rows = _segment_grid(segs, rows, device)
    mc, vc = (_launch.new_output(g.shape, torch.uint8, device) for _ in range(2))
    if n_seg:
        _launch.launch(
            _kernels()[4], (-(-n_seg // rows),), g, m[0].contiguous(), m[1].contiguous(),
            v[0].contiguous(), v[1].contiguous(),
            _launch.to_device(code_m.float().contiguous(), device),
            _launch.to_device(code_v.float().contiguous(), device), absmax_m.contiguous(),
            absmax_v.contiguous(), mc, vc, *_segment_args(segs, device),
            _adam_scalars(s, device), n_seg, ROWS=rows, TILE=tile)
    return mc, vc


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



def adam8bit_sharded_uses_kernel(g: Tensor, m: Q, v: Q, code_m: Tensor, code_v: Tensor,
                                 block_size: int) -> bool:
    """Whether the sharded step's two passes (:func:`adam8bit_absmax_triton`,
    :func:`adam8bit_requantize_triton`) run as kernels: when :func:`adam8bit_step` would take
    its kernel for a whole state (float32 gradient of >= 1 dim, 256-entry maps,
    :func:`funcpar.kernels.use_kernels`). Otherwise the caller runs the references (or its own
    code doing the same: :mod:`funcpar.optim.quant8`)."""
    return (g.dtype == torch.float32 and g.dim() > 0 and code_v.numel() == 256
            and _ok(code_m, block_size, g, m[0], m[1], v[0], v[1]))
