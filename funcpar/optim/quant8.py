"""Blockwise 8-bit quantization of optimizer states (the whole-tensor work in
:mod:`funcpar.kernels.quant8`: a Triton kernel on CUDA, its plain-torch reference elsewhere).

Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization" (arXiv 2110.02861): a
tensor is cut into blocks of ``block_size`` consecutive elements (row-major order); each block
keeps its absolute maximum ``absmax`` (float32) and each element the uint8 index of the code
nearest to ``x / absmax`` in a fixed 256-entry *dynamic map* (Dettmers 2015, arXiv 1511.04561):
a sign, a run of zero bits that sets a decimal exponent, and a linear fraction after it, so that
small magnitudes keep a relative precision that a linear map would lose.

The maps are built the way ``bitsandbytes.functional.create_dynamic_map`` builds them (equal to
it element for element, tested). Quantization picks the nearest code of the float32 quotient
``x / absmax`` (distances compared in float32, a tie going to the lower index). The absmax are
bit-identical to ``bitsandbytes.functional.quantize_blockwise``'s; its codes are not always: its
CPU search (a table-driven "Direct2" binary search, corrected by one neighbour only) returns a
code a few places off for some small quotients (measured: ~6% of N(0,1)-like values, never
more than 3.1e-5 farther than the nearest code, in units of absmax). Ours is the nearest code
everywhere (tested against brute force and against bitsandbytes: never farther). An all-zero
block gets the code of 0.0 here. Inputs of any floating dtype are first rounded to float32.

Round trip. With ``B = roundtrip_bound(code)`` (the largest distance from a point of the map's
domain, ``[-1, 1]`` for a signed map and ``[0, 1]`` for an unsigned one, to its nearest code):
``|dequantize(quantize(x)) - x| <= (B + 2**-22) * absmax`` element-wise, with the block's
absmax; ``2**-22`` covers the float32 roundings of the quotient, the input and the product.
``B = 0.00703125`` for the signed map (half the step of its top decade, and the distance from
-1 to its lowest code, -0.99296875: the signed map has +1 but not -1) and ``B = 0.003515625``
for the unsigned map. An unsigned map is for nonnegative data (a negative value becomes 0).

Padding. When ``numel`` is not a multiple of ``block_size`` the last block is shorter: for the
computation it is padded with zeros, which cannot change its absmax, and the padding is dropped
again, so ``codes`` always has the input's shape (the shape is recovered from ``codes``) and
``absmax`` has ``ceil(numel / block_size)`` entries.

Sharded tensors (``layout=``). A state that is split over ranks (a tensor-parallel shard, say)
is quantized in the blocks of the *whole* tensor, so that every element gets the code and the
absmax it gets in one process, however the split cuts the blocks: the blocks are
``block_size`` consecutive elements of the global tensor in row-major order, each rank finds
the absmax of its part of every block, and one all-reduce (max) over the axes that split the
tensor gives the global absmax, of ``ceil(global numel / block_size)`` entries, identical on
every rank (purpose ``8-bit absmax``: 4 bytes per block, 1/64 of a float32 state at the default
``block_size=256``). ``codes`` keep the local shape. Dequantization is local. The quantized
values are then those of one process element for element (the quotient and the product are
the same float32 operations on the same float32 numbers). :func:`adam8bit_phases` is GaLore's
8-bit Adam step written as phases: the absmax all-reduce becomes a :class:`MaxPartial` request
that the optimizer completes for all leaves together (one message per mesh axis), and on the
kernel path the step is two Triton passes around it (:mod:`funcpar.kernels.quant8`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from jaxtyping import Float, Float32
from torch import Tensor

from funcpar.kernels.dispatch import differentiable
from funcpar.kernels.quant8 import (
    Adam8bitScalars,
    Segments,
    adam8bit_absmax_triton,
    adam8bit_math,
    adam8bit_requantize_triton,
    adam8bit_sharded_uses_kernel,
    adam8bit_step,
    block_segments,
    dequantize_blocks,
    dequantize_global_reference,
    local_absmax_reference,
    nearest_code,
    quantize_blocks,
    quantize_global_reference,
)
from funcpar.shard.layout import Layout, Shard, shard_tensor
from funcpar.shard.reduce import Reducible, global_shape

__all__ = [
    "MaxPartial",
    "Quantized",
    "adam8bit_phases",
    "dequantize",
    "dynamic_map",
    "nearest_code",
    "num_blocks",
    "quantize",
    "quantized_zeros",
    "roundtrip_bound",
]


#: The purpose of the absmax all-reduce (max) of a sharded state, in the comm log.
ABSMAX = "8-bit absmax"


class Quantized(NamedTuple):
    """A blockwise-quantized tensor: a pytree of two tensors; the shape is ``codes.shape``."""

    codes: Tensor  # uint8, the original tensor's shape
    absmax: Tensor  # float32, (ceil(numel / block_size),)


@functools.cache
def _dynamic_map_cpu(signed: bool, max_exponent_bits: int, total_bits: int) -> Tensor:
    # The bit budget: 1 sign bit (an unsigned map spends it on the fraction instead), up to
    # max_exponent_bits leading zeros choosing the decade, the rest fraction bits.
    magnitude_bits = total_bits - 1
    top_exponent = max_exponent_bits - 1
    values: list[Tensor] = []

    def decade(e: int, n_steps: int) -> None:
        # n_steps equal cells of [0.1, 1], represented by their midpoints, scaled to the decade
        # 10**(e - top_exponent); float32 throughout, as bitsandbytes computes them.
        edges = torch.linspace(0.1, 1.0, n_steps + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scaled = mids * (10.0 ** (e - top_exponent))
        values.append(scaled)
        if signed:
            values.append(-scaled)

    for e in range(max_exponent_bits):
        fraction_bits = e + magnitude_bits - max_exponent_bits + (0 if signed else 1)
        decade(e, 2**fraction_bits)
    leftover = 2 ** (magnitude_bits - max_exponent_bits) - 1
    if leftover > 0:
        decade(max_exponent_bits - 1, leftover)
    flat = torch.cat(values + [torch.tensor([0.0, 1.0], dtype=torch.float32)])
    if flat.numel() > 256:
        raise ValueError(f"a map with total_bits={total_bits}, max_exponent_bits="
                         f"{max_exponent_bits} has {flat.numel()} codes, more than 256")
    # Unused codes are zeros, as in bitsandbytes (ties resolve to the lowest index).
    flat = torch.cat([flat, torch.zeros(256 - flat.numel(), dtype=torch.float32)])
    return flat.sort().values


def dynamic_map(
    signed: bool = True,
    max_exponent_bits: int = 7,
    total_bits: int = 8,
    *,
    device: torch.device | str | None = None,
) -> Float32[Tensor, 256]:
    """The sorted 256-entry dynamic quantization map (float32), signed or unsigned.

    ``signed``: values in ``[-0.993, 1]`` (m-like states); unsigned: ``[0, 1]`` with one more
    fraction bit (v-like, nonnegative states). Equal to bitsandbytes' ``create_dynamic_map``.
    """
    if not 1 <= total_bits <= 8:
        raise ValueError(f"total_bits must be in [1, 8], got {total_bits}")
    if not 1 <= max_exponent_bits <= total_bits - 1 + (0 if signed else 1):
        raise ValueError(f"max_exponent_bits={max_exponent_bits} does not fit {total_bits} bits")
    code = _dynamic_map_cpu(bool(signed), int(max_exponent_bits), int(total_bits))
    return code.clone() if device is None else code.to(device, copy=True)


def roundtrip_bound(code: Float32[Tensor, " n_codes"]) -> float:
    """The largest distance from a point of the map's domain to its nearest code.

    The domain is ``[-1, 1]`` when the map has a negative code, else ``[0, 1]``; relative to a
    block's absmax this bounds the round-trip error (plus ``2**-22`` for float32 rounding).
    """
    c = code.double().sort().values
    low = -1.0 if float(c[0]) < 0 else 0.0
    half_gap = float((c[1:] - c[:-1]).max()) / 2 if c.numel() > 1 else 0.0
    return max(half_gap, float(c[0]) - low, 1.0 - float(c[-1]))


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _global_blocks(x: Tensor, layout: Reducible, block_size: int) -> tuple[Tensor, int]:
    """For each element of the shard ``x`` (row-major, flat) the index of its block in the
    whole tensor, and the whole tensor's number of blocks."""
    if not isinstance(layout, Layout):
        raise TypeError(f"8-bit quantization of a sharded state needs a funcpar Layout (to place "
                        f"its elements in the global blocks), got {layout!r}")
    shape = tuple(layout.global_shape)
    if tuple(x.shape) != layout.local_shape():
        raise ValueError(f"8-bit state of {layout.name or 'a leaf'}: shard shape "
                         f"{tuple(x.shape)}, but the layout (global {shape}) gives "
                         f"{layout.local_shape()}")
    # The global flat index is sum_d index_d * stride_d; each dim's global indices of this
    # rank's elements are the shard of arange(n_d) under that dim's split (uneven, nested and
    # blocked splits included).
    flat = torch.zeros((), dtype=torch.int64, device=x.device)
    stride = 1
    for d in reversed(range(len(shape))):
        axes = layout.dim_axes[d]
        one = Layout(layout.mesh, (shape[d],), {a: Shard(0) for a in axes},
                     blocks={0: layout.dim_blocks[d]}, name=layout.name)
        idx = shard_tensor(torch.arange(shape[d], dtype=torch.int64), one).to(x.device)
        view = [1] * len(shape)
        view[d] = -1
        flat = flat + idx.view(view) * stride
        stride *= shape[d]
    return (flat.expand(x.shape).reshape(-1) // block_size), num_blocks(math.prod(shape),
                                                                       block_size)


def _refuse_differentiation(*tensors: object) -> None:
    # Rounding to codes has no useful derivative: refuse rather than silently cut the graph.
    if differentiable(*tensors):
        raise RuntimeError("8-bit optimizer states are not differentiable (the moments are "
                           "rounded to 8-bit codes, and this step has inputs that require grad);"
                           " differentiate through updates with full-precision states "
                           "(eight_bit=False), see docs/FUNCTIONAL.md")


def quantize(
    x: Float[Tensor, "*shape"],
    code: Float32[Tensor, " n_codes"],
    block_size: int = 256,
    *,
    layout: Reducible | None = None,
) -> Quantized:
    """Blockwise quantization of ``x`` (rounded to float32 first) with the map ``code``.

    ``layout``: ``x`` is this rank's shard of a tensor of that layout; it is quantized in the
    whole tensor's blocks (module docstring), at the cost of one all-reduce of the absmax.
    """
    _check_block_size(block_size)
    _refuse_differentiation(x)
    if code.device != x.device:
        code = code.to(x.device, non_blocking=True)
    if global_shape(x, layout) != tuple(x.shape):
        block, nb = _global_blocks(x, layout, block_size)
        local = local_absmax_reference(x, block, nb)
        absmax = layout.all_reduce(local, tuple(range(x.dim())), "max", ABSMAX)
        return Quantized(quantize_global_reference(x, absmax, block, code), absmax)
    # The whole tensor: the Triton kernel on CUDA, the plain-torch reference elsewhere.
    return Quantized(*quantize_blocks(x, code, block_size))


def dequantize(
    q: Quantized,
    code: Float32[Tensor, " n_codes"],
    block_size: int = 256,
    dtype: torch.dtype = torch.float32,
    *,
    layout: Reducible | None = None,
) -> Tensor:
    """``code[codes] * absmax`` per block (float32 product), returned as ``dtype``.

    ``layout``: ``q`` holds this rank's codes of a tensor of that layout and the whole tensor's
    absmax (as :func:`quantize` with ``layout`` makes it); no communication.
    """
    _check_block_size(block_size)
    codes, absmax = q
    n = codes.numel()
    if code.device != codes.device:
        code = code.to(codes.device, non_blocking=True)
    if global_shape(codes, layout) != tuple(codes.shape):
        block, nb = _global_blocks(codes, layout, block_size)
        if absmax.numel() != nb:
            raise ValueError(
                f"8-bit state of {getattr(layout, 'name', '') or 'a leaf'}: absmax has "
                f"{absmax.numel()} blocks but the global shape {tuple(layout.global_shape)} in "
                f"blocks of {block_size} needs {nb}: quantized for another layout?")
        return dequantize_global_reference(codes, absmax, block, code, dtype)
    if absmax.numel() != num_blocks(n, block_size):
        raise ValueError(
            f"absmax has {absmax.numel()} blocks but {n} codes in blocks of {block_size} need "
            f"{num_blocks(n, block_size)}: wrong block_size?"
        )
    return dequantize_blocks(codes, absmax, code, block_size, dtype)


def quantized_zeros(
    shape: tuple[int, ...] | torch.Size,
    code: Float32[Tensor, " n_codes"],
    block_size: int = 256,
    device: torch.device | str | None = None,
    *,
    layout: Reducible | None = None,
) -> Quantized:
    """The quantized form of ``torch.zeros(shape)``: every code is the map's 0.0, absmax 0.

    ``layout``: ``shape`` is this rank's shard of a tensor of that layout; the absmax then
    covers the whole tensor's blocks (as :func:`quantize` with ``layout`` keeps them).
    """
    _check_block_size(block_size)
    zero = (code == 0).nonzero()
    if zero.numel() == 0:
        raise ValueError("the map has no code for 0.0")
    n = math.prod(global_shape(torch.empty(shape, device="meta"), layout))
    codes = torch.full(tuple(shape), int(zero[0, 0]), dtype=torch.uint8, device=device)
    absmax = torch.zeros(num_blocks(n, block_size), dtype=torch.float32, device=device)
    return Quantized(codes, absmax)


# --------------------------------------------------------------------------------------------
# The 8-bit Adam step of a (possibly sharded) state, as a phased step
# --------------------------------------------------------------------------------------------


class MaxPartial(NamedTuple):
    """A max-reduction a phased step asks for (as :class:`funcpar.shard.reduce.Partial` asks
    for a sum): ``x`` (this rank's maxima) combined with max over the axes that split ``dims``
    of the leaf ``layout`` describes (``dims=None``: all of its dims). The driver completes all
    of a phase's MaxPartials with one ``sum_partials(op="max")`` call: one all-reduce per mesh
    axis (:func:`funcpar.optim.galore`'s update does)."""

    x: Tensor
    layout: Reducible | None
    dims: int | tuple[int, ...] | None
    purpose: str


@functools.lru_cache(maxsize=256)
def _segments(layout: Layout, block_size: int, device: str) -> Segments:
    # _global_blocks reads only the shard's shape: a zero-stride stand-in allocates nothing.
    shard = torch.empty((), dtype=torch.uint8).expand(layout.local_shape())
    segs = block_segments(*_global_blocks(shard, layout, block_size))
    return segs._replace(start=segs.start.to(device), length=segs.length.to(device),
                         block=segs.block.to(device))


def global_segments(layout: Layout, block_size: int, device: torch.device) -> Segments:
    """The :class:`~funcpar.kernels.quant8.Segments` of this rank's shard of a tensor of
    ``layout`` in blocks of ``block_size``; cached per layout (the mesh, hence the rank, is part
    of a Layout's identity), block size and device."""
    return _segments(layout, int(block_size), str(device))


def _check_states(g: Tensor, m: Quantized, v: Quantized, n_blocks: int, layout: Layout,
                  block_size: int) -> None:
    where = getattr(layout, "name", "") or "a leaf"
    for name, q in (("m", m), ("v", v)):
        if tuple(q.codes.shape) != tuple(g.shape):
            raise ValueError(f"8-bit state {name} of {where}: codes of shape "
                             f"{tuple(q.codes.shape)} for a gradient shard of {tuple(g.shape)}")
        if q.absmax.numel() != n_blocks:
            raise ValueError(
                f"8-bit state {name} of {where}: absmax has {q.absmax.numel()} blocks but the "
                f"global shape {tuple(layout.global_shape)} in blocks of {block_size} needs "
                f"{n_blocks}: quantized for another layout?")


def adam8bit_phases(
    g: Tensor, m: Quantized, v: Quantized, code_m: Tensor, code_v: Tensor, block_size: int,
    scalars: Adam8bitScalars, *, layout: Reducible | None = None,
):
    """GaLore's inner Adam on 8-bit ``m`` (signed map) and ``v`` (unsigned map): a phased step
    (:func:`funcpar.shard.reduce.run_phased`) returning ``(direction, m', v')`` quantized.

    A whole state (no layout, or nothing cut) takes :func:`~funcpar.kernels.quant8.adam8bit_step`
    (one fused pass; no phase). A sharded state's blocks are the whole state's, so its new
    absmax are maxima over ranks: one phase asks for both (``MaxPartial``, purpose
    ``"8-bit absmax"``), which the driver completes for all leaves together. On the kernel path
    (:func:`~funcpar.kernels.quant8.adam8bit_sharded_uses_kernel`) pass 1 writes the direction
    and the local maxima and pass 2 the codes; on the reference path the same torch operations
    as :func:`dequantize` / :func:`quantize` with ``layout`` (bit-identical to them).
    """
    _refuse_differentiation(g, *scalars)
    if code_m.device != g.device:  # as quantize and dequantize: the maps follow the state
        code_m = code_m.to(g.device, non_blocking=True)
        code_v = code_v.to(g.device, non_blocking=True)
    if global_shape(g, layout) == tuple(g.shape):
        direction, mq, vq = adam8bit_step(g, m, v, code_m, code_v, block_size, scalars)
        return direction, Quantized(*mq), Quantized(*vq)
    if adam8bit_sharded_uses_kernel(g, m, v, code_m, code_v, block_size):
        if not isinstance(layout, Layout):
            _global_blocks(g, layout, block_size)  # raises the TypeError naming the need
        segs = global_segments(layout, block_size, g.device)
        # The kernels index with these: a mismatch must be an error, not a stray read.
        _check_states(g, m, v, segs.n_blocks, layout, block_size)
        direction, am_m, am_v = adam8bit_absmax_triton(g, m, v, code_m, code_v, segs, scalars)
        am_m, am_v = yield [MaxPartial(am_m, layout, None, ABSMAX),
                            MaxPartial(am_v, layout, None, ABSMAX)]
        mc, vc = adam8bit_requantize_triton(g, m, v, code_m, code_v, segs, scalars, am_m, am_v)
        return direction, Quantized(mc, am_m), Quantized(vc, am_v)
    block, nb = _global_blocks(g, layout, block_size)
    _check_states(g, m, v, nb, layout, block_size)
    m_f, v_f, direction = adam8bit_math(
        dequantize_global_reference(m.codes, m.absmax, block, code_m, g.dtype),
        dequantize_global_reference(v.codes, v.absmax, block, code_v, g.dtype), g, scalars)
    am_m, am_v = yield [MaxPartial(local_absmax_reference(m_f, block, nb), layout, None, ABSMAX),
                        MaxPartial(local_absmax_reference(v_f, block, nb), layout, None, ABSMAX)]
    return (direction, Quantized(quantize_global_reference(m_f, am_m, block, code_m), am_m),
            Quantized(quantize_global_reference(v_f, am_v, block, code_v), am_v))
