"""Fused Lamb passes: references, Triton kernels, dispatch.

Lamb needs two per-leaf norms before it can update anything, so it runs in two passes with the
layout-aware reduction of the norms between them (done by :mod:`funcpar.optim.lamb`, through
:func:`funcpar.shard.reduce.sum_partial`, so tensor-parallel and ZeRO shards work unchanged):

1. :func:`lamb_moments`: ``m' = b1 m + c g``, ``v' = b2 v + (1 - b2) g^2`` (``g`` negated with
   ``maximize``), written; the direction ``a`` (``m'/bc1 / (sqrt(v'/bc2) + eps)`` with
   ``bias_correction="moments"``, else ``m' / (sqrt(v') + eps)``; ``+ wd p`` with decay
   ``"in_update"``) and the weight ``w`` (``p``, or ``p (1 - lr wd)`` with ``"decoupled"``
   decay) are *not* written: each program returns its tile's ``sum(w^2)`` and ``sum(a^2)``, and
   a second tiny kernel adds those per leaf in a fixed order (reproducible, no atomics).
2. :func:`lamb_update`: ``a`` and ``w`` recomputed from ``p, m', v'``, then
   ``u = (w - p) - coef a`` with the per-leaf ``coef = step size * trust ratio``, written as
   ``u`` or as ``p + u``.

Bytes per parameter (fp32): pass 1 reads ``p, g, m, v`` and writes ``m, v`` (24 B), pass 2
reads ``p, m, v`` and writes ``p`` (16 B): 40 B, against the 28 B of one AdamW-like pass.
Writing ``a`` in pass 1 and reading ``a, p`` in pass 2 costs the same 40 B and an extra buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, no_type_check

import torch
from torch import Tensor

from funcpar.kernels import _access, _launch
from funcpar.kernels.inplace import fast_path_ok

__all__ = [
    "LambScalars",
    "lamb_direction",
    "lamb_fast_ok",
    "lamb_kernels_apply",
    "lamb_moments_reference",
    "lamb_moments_triton",
    "lamb_update_reference",
    "lamb_update_triton",
]


class LambScalars(NamedTuple):
    beta1: float
    beta2: float
    m_coef: float  # 1 - beta1, or 1 without grad averaging
    bc1: Tensor | float  # 1 - b1^t
    bc2: Tensor | float  # 1 - b2^t
    eps: Tensor | float
    weight_decay: Tensor | float
    shrink: Tensor | float  # 1 - lr * weight_decay (decoupled decay)
    moments: bool  # bias_correction == "moments"
    in_update: bool  # weight_decay_mode == "in_update"
    maximize: bool


def lamb_direction(
    g: Tensor, p: Tensor, m: Tensor, v: Tensor, use_decay: bool, s: LambScalars,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reference for one leaf: ``(m', v', a, w)`` exactly as :func:`funcpar.optim.lamb`."""
    if s.maximize:
        g = -g
    # A Python number alpha: torch.add fuses it the way the references' add_ does.
    m = torch.add(m * s.beta1, g, alpha=s.m_coef)
    v = torch.addcmul(v * s.beta2, g, g, value=1 - s.beta2)
    a, w = _direction_of(p, m, v, use_decay, s)
    return m, v, a, w


def _direction_of(p: Tensor, m: Tensor, v: Tensor, use_decay: bool,
                  s: LambScalars) -> tuple[Tensor, Tensor]:
    """``(a, w)`` from the new moments ``m, v``: both passes' reference (the kernels'
    ``lamb_direction_jit``)."""
    if s.moments:
        a = (m / s.bc1) / ((v / s.bc2).sqrt() + s.eps)
    else:
        a = m / (v.sqrt() + s.eps)
    w = p
    if use_decay and s.in_update:
        a = a + s.weight_decay * p
    elif use_decay:
        # pytorch_optimizer shrinks the weight first; its norm is the shrunk one's.
        w = p * s.shrink
    return a, w


Leaves = Sequence[Tensor]


def lamb_moments_reference(
    grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves, decay: Sequence[bool],
    s: LambScalars,
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Pass 1 in plain torch: ``(m', v', sums)`` with ``sums[j] = (sum w_j^2, sum a_j^2)``
    over this process's part of leaf ``j`` (float64, ``[n_leaves, 2]``)."""
    ms, vs, sums = [], [], []
    for g, p, m, v, dec in zip(grads, params, exp_avg, exp_avg_sq, decay, strict=True):
        m, v, a, w = lamb_direction(g, p, m, v, dec, s)
        ms.append(m)
        vs.append(v)
        sums.append(torch.stack([w.double().square().sum(), a.double().square().sum()]))
    device = grads[0].device if len(grads) else None
    out = torch.stack(sums) if sums else torch.zeros((0, 2), dtype=torch.float64, device=device)
    return ms, vs, out


def lamb_update_reference(
    params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves, decay: Sequence[bool], coef: Tensor,
    s: LambScalars, *, write_params: bool = False,
) -> list[Tensor]:
    """Pass 2 in plain torch: ``u = (w - p) - coef_j a`` per leaf (``coef`` float64
    ``[n_leaves]``; its float32 rounding multiplies a float32 ``a``), or ``p + u``."""
    outs = []
    for j, (p, m, v, dec) in enumerate(zip(params, exp_avg, exp_avg_sq, decay, strict=True)):
        a, w = _direction_of(p, m, v, dec, s)
        u = (w - p) - coef[j] * a
        outs.append(p + u.to(p.dtype) if write_params else u)
    return outs


def _build():
    global tl, triton, lamb_direction_jit, add_combine, tile_of, full_tile, leaf_load
    global leaf_store, update_store, lamb_moments_tile, lamb_update_tile
    import triton
    import triton.language as tl

    # Not tl.sum: see _launch.combine_fn.
    add_combine = _launch.combine_fn()
    tile_of = _launch.leaf_tile()
    full_tile, leaf_load, leaf_store, _param_load, update_store = _access.access()

    @triton.jit
    @no_type_check
    def lamb_direction_jit(p, m, v, dflag, scal, MOMENTS: tl.constexpr,
                           IN_UPDATE: tl.constexpr):
        bc1 = tl.load(scal + 4)
        bc2 = tl.load(scal + 5)
        eps = tl.load(scal + 6)
        wd = tl.load(scal + 7)
        shrink = tl.load(scal + 8)
        if MOMENTS:
            a = tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps)
        else:
            a = tl.div_rn(m, tl.sqrt_rn(v) + eps)
        w = p
        if IN_UPDATE:
            a = tl.where(dflag != 0, a + wd * p, a)
        else:
            w = tl.where(dflag != 0, p * shrink, p)
        return a, w

    @triton.jit
    @no_type_check
    def lamb_moments_tile(row, offs, n, dflag, scal, P: tl.constexpr, G: tl.constexpr,
                          M: tl.constexpr, V: tl.constexpr, MO: tl.constexpr, VO: tl.constexpr,
                          MOMENTS: tl.constexpr, IN_UPDATE: tl.constexpr,
                          MAXIMIZE: tl.constexpr, FULL: tl.constexpr):
        # Leaf row: numel, decay flag, p, g, m, v, m out, v out. Returns the tile's sums of
        # the squares of the weight and of the direction.
        mask = offs < n
        beta1 = tl.load(scal)
        m_coef = tl.load(scal + 1)
        beta2 = tl.load(scal + 2)
        c2 = tl.load(scal + 3)  # 1 - beta2
        p = leaf_load(row, 2, offs, mask, P, FULL).to(tl.float32)
        g = leaf_load(row, 3, offs, mask, G, FULL).to(tl.float32)
        if MAXIMIZE:
            g = -g
        m = leaf_load(row, 4, offs, mask, M, FULL).to(tl.float32)
        v = leaf_load(row, 5, offs, mask, V, FULL).to(tl.float32)
        m = tl.fma(g, m_coef, m * beta1).to(MO)  # torch.add(m * b1, g, alpha=c)
        v = (v * beta2 + (c2 * g) * g).to(VO)  # torch.addcmul(v * b2, g, g, value=1 - b2)
        leaf_store(row, 6, offs, m, mask, MO, FULL)
        leaf_store(row, 7, offs, v, mask, VO, FULL)
        a, w = lamb_direction_jit(p, m.to(tl.float32), v.to(tl.float32), dflag, scal,
                                  MOMENTS, IN_UPDATE)
        # Masked lanes load zeros: a = 0 / (0 + eps) = 0 and w = 0 add nothing.
        return tl.reduce(w * w, 0, add_combine), tl.reduce(a * a, 0, add_combine)

    @triton.jit
    @no_type_check
    def lamb_moments_kernel(table, tiles, scal, partials, NCOL: tl.constexpr,
                            BLOCK: tl.constexpr, P: tl.constexpr, G: tl.constexpr,
                            M: tl.constexpr, V: tl.constexpr, MO: tl.constexpr,
                            VO: tl.constexpr, MOMENTS: tl.constexpr, IN_UPDATE: tl.constexpr,
                            MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr):
        # The same body compiled twice: 16-byte accesses on full tiles (funcpar.kernels._access).
        pid, _leaf, row, offs, n, dflag = tile_of(table, tiles, NCOL, BLOCK)
        if full_tile(tiles, pid, n, BLOCK, ALIGNED):
            ww, aa = lamb_moments_tile(row, offs, n, dflag, scal, P, G, M, V, MO, VO, MOMENTS,
                                       IN_UPDATE, MAXIMIZE, True)
        else:
            ww, aa = lamb_moments_tile(row, offs, n, dflag, scal, P, G, M, V, MO, VO, MOMENTS,
                                       IN_UPDATE, MAXIMIZE, False)
        tl.store(partials + 2 * pid, ww)
        tl.store(partials + 2 * pid + 1, aa)

    @triton.jit
    @no_type_check
    def lamb_update_tile(row, offs, n, dflag, scal, c, P: tl.constexpr, M: tl.constexpr,
                         V: tl.constexpr, U: tl.constexpr, MOMENTS: tl.constexpr,
                         IN_UPDATE: tl.constexpr, WRITE_PARAMS: tl.constexpr,
                         FULL: tl.constexpr):
        # Leaf row: numel, decay flag, p, m', v', out; c: the leaf's trust-ratio coefficient.
        mask = offs < n
        p = leaf_load(row, 2, offs, mask, P, FULL).to(tl.float32)
        m = leaf_load(row, 3, offs, mask, M, FULL).to(tl.float32)
        v = leaf_load(row, 4, offs, mask, V, FULL).to(tl.float32)
        a, w = lamb_direction_jit(p, m, v, dflag, scal, MOMENTS, IN_UPDATE)
        update_store(row, 5, offs, p, (w - p) - c * a, mask, P, U, WRITE_PARAMS, FULL)

    @triton.jit
    @no_type_check
    def lamb_update_kernel(table, tiles, scal, coef, NCOL: tl.constexpr, BLOCK: tl.constexpr,
                           P: tl.constexpr, M: tl.constexpr, V: tl.constexpr, U: tl.constexpr,
                           MOMENTS: tl.constexpr, IN_UPDATE: tl.constexpr,
                           WRITE_PARAMS: tl.constexpr, ALIGNED: tl.constexpr):
        pid, leaf, row, offs, n, dflag = tile_of(table, tiles, NCOL, BLOCK)
        c = tl.load(coef + leaf)
        if full_tile(tiles, pid, n, BLOCK, ALIGNED):
            lamb_update_tile(row, offs, n, dflag, scal, c, P, M, V, U, MOMENTS, IN_UPDATE,
                             WRITE_PARAMS, True)
        else:
            lamb_update_tile(row, offs, n, dflag, scal, c, P, M, V, U, MOMENTS, IN_UPDATE,
                             WRITE_PARAMS, False)

    return lamb_moments_kernel, lamb_update_kernel


_kernels = _launch.lazy_kernels(_build)


def _scalars(s: LambScalars, device: torch.device) -> Tensor:
    return _launch.device_scalars([s.beta1, s.m_coef, s.beta2, 1 - s.beta2, s.bc1, s.bc2, s.eps,
                                   s.weight_decay, s.shrink], device)


def _check_one_group(tensors: Sequence[Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the Lamb kernels take the leaves of one device, got "
                         f"{sorted(map(str, devices))}")


def lamb_moments_triton(
    grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves, decay: Sequence[bool],
    s: LambScalars, *, block: int | None = None,
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """:func:`lamb_moments_reference` by the Triton kernels (one launch per dtype group plus
    the per-leaf sums). All leaves on one device."""
    block = block or _launch.BLOCK
    n = len(grads)
    _check_one_group([*grads, *params])
    ms: list = [None] * n
    vs: list = [None] * n
    device = grads[0].device if n else torch.device("cpu")
    sums = torch.zeros((n, 2), dtype=torch.float64, device=device)
    groups = _launch.group_by(n, lambda i: (grads[i].dtype, params[i].dtype, exp_avg[i].dtype,
                                            exp_avg_sq[i].dtype))
    for (gd, pd, md, vd), idx in groups.items():
        mo, vo = torch.promote_types(md, gd), torch.promote_types(vd, gd)
        group = _launch.LeafGroup(device, block)
        for i in idx:
            g, p = grads[i].contiguous(), params[i].contiguous()
            m, v = exp_avg[i].contiguous(), exp_avg_sq[i].contiguous()
            ms[i] = _launch.new_output(p.shape, mo, device)
            vs[i] = _launch.new_output(p.shape, vo, device)
            # Leaf row: numel, decay flag, p, g, m, v, m out, v out.
            group.add(i, decay[i], p, g, m, v, ms[i], vs[i])
        if not group:
            continue
        tiles, first = group.tiles()
        partials = _launch.new_output((tiles.shape[0], 2), torch.float32, device)
        T = _launch.tl_dtype
        group.launch(_kernels()[0], _scalars(s, device), partials, P=T(pd), G=T(gd), M=T(md),
                     V=T(vd), MO=T(mo), VO=T(vo), MOMENTS=s.moments, IN_UPDATE=s.in_update,
                     MAXIMIZE=s.maximize, ALIGNED=group.aligned)
        sums[torch.tensor(group.live, device=device)] = _launch.segment_sums(partials, first)
    return ms, vs, sums


def lamb_update_triton(
    params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves, decay: Sequence[bool], coef: Tensor,
    s: LambScalars, *, write_params: bool = False, block: int | None = None,
) -> list[Tensor]:
    """:func:`lamb_update_reference` by the Triton kernel."""
    block = block or _launch.BLOCK
    n = len(params)
    _check_one_group(params)
    outs: list = [None] * n
    device = params[0].device if n else torch.device("cpu")
    coef32 = coef.to(device=device, dtype=torch.float32)
    groups = _launch.group_by(n, lambda i: (params[i].dtype, exp_avg[i].dtype,
                                            exp_avg_sq[i].dtype, params[i].dim() == 0))
    for (pd, md, vd, scalar), idx in groups.items():
        ud = torch.promote_types(torch.promote_types(pd, md), vd)
        if scalar:  # the reference's float64 coef times a 0-d leaf's a promotes to float64
            ud = torch.promote_types(ud, torch.float64)
        group = _launch.LeafGroup(device, block)
        for i in idx:
            p, m, v = params[i].contiguous(), exp_avg[i].contiguous(), exp_avg_sq[i].contiguous()
            outs[i] = _launch.new_output(p.shape, pd if write_params else ud, device)
            # Leaf row: numel, decay flag, p, m', v', out.
            group.add(i, decay[i], p, m, v, outs[i])
        if not group:
            continue
        live = group.live
        group_coef = coef32 if len(live) == n else coef32[torch.tensor(live, device=device)]
        T = _launch.tl_dtype
        group.launch(_kernels()[1], _scalars(s, device), group_coef.contiguous(), P=T(pd),
                     M=T(md), V=T(vd), U=T(ud), MOMENTS=s.moments, IN_UPDATE=s.in_update,
                     WRITE_PARAMS=write_params, ALIGNED=group.aligned)
    return outs


def lamb_fast_ok(tensors: Sequence[Tensor], hyper: Sequence[object] = ()) -> bool:
    """Whether a Lamb step over ``tensors`` (grads, params and moments of whole leaves) with
    the tensor ``hyper``-parameters may take the eager in-place path of
    :func:`funcpar.optim.lamb` (:func:`funcpar.kernels.inplace.fast_path_ok`: not when the step
    must be differentiable, nor under a torch.func transform or torch.compile's tracing;
    contiguous leaves of one dtype per leaf)."""
    return (bool(tensors) and not torch.compiler.is_compiling()
            and fast_path_ok(*tensors, *hyper) and all(t.is_contiguous() for t in tensors))


def lamb_kernels_apply(*tensors: Tensor | None, hyper: Sequence[object] = ()) -> bool:
    """Whether a Lamb step over ``tensors`` runs the kernels: :func:`funcpar.kernels.use_kernels`
    says so, every tensor has a kernel dtype and all are on one device. (Lamb's reference is
    :func:`lamb_direction` a leaf at a time with the norms in between, in
    :func:`funcpar.optim.lamb`; :func:`lamb_moments_reference` and :func:`lamb_update_reference`
    are the two passes in plain torch, what the kernels are tested against.) ``hyper``: the
    step's tensor hyperparameters, counted in the differentiability check (an ``lr`` that
    requires grad keeps the kernels out; in mode ``triton`` it is an error)."""
    return _launch.kernels_apply(*tensors, same_device=True, hyper=hyper)
