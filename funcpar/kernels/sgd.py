"""Fused SGD step (momentum, dampening, Nesterov, coupled weight decay): reference, Triton
kernel, dispatch.

Per element, ``d = g`` (``-g`` with ``maximize``) ``[+ wd * p]``; with momentum ``mu``:
``b' = d`` on the first step, else ``b' = mu b + (1 - dampening) d``; the direction is
``d + mu b'`` (Nesterov) or ``b'``; ``u = -lr * direction`` (``-lr * d`` without momentum), and
``p' = p + u`` (``write_params=True``) or ``u``.

Bytes per parameter (fp32): ``p`` r/w, ``g`` r, ``b`` r/w: 20 B with momentum, 12 B without.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, no_type_check

import torch
from torch import Tensor

from funcpar.kernels import _access, _launch
from funcpar.kernels.inplace import (
    decay_calls,
    dense,
    fast_path_ok,
    fused_leaves_ok,
    writable,
    write_back,
)
from funcpar.kernels.multi_tensor import add_scaled, in_dtype, multi_tensor_ok, per_dtype

__all__ = ["SGDScalars", "sgd_fast", "sgd_leaf", "sgd_reference", "sgd_step", "sgd_triton"]


class SGDScalars(NamedTuple):
    lr: Tensor | float  # 0-d float64 (a schedule's value) or a number
    weight_decay: Tensor | float
    first: Tensor | bool  # 0-d bool: this is the first step (the buffer starts at d)
    momentum: float
    dampening: float


def _t(x: Tensor | float) -> Tensor:
    return x if torch.is_tensor(x) else torch.tensor(float(x), dtype=torch.float64)


def sgd_leaf(
    g: Tensor, p: Tensor, buf: Tensor | None, use_decay: bool, s: SGDScalars, *,
    nesterov: bool, maximize: bool, cast: dict[torch.dtype, tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The reference for one leaf: ``(u, b')`` exactly as torch.optim.SGD. ``cast``, when
    given, caches the step's scalars per dtype across a loop over leaves."""
    # Hyperparameters in the leaf's dtype (a 0-d float64 would promote 0-d leaves).
    cast = {} if cast is None else cast
    if g.dtype not in cast:
        cast[g.dtype] = in_dtype(g.dtype, _t(s.lr), _t(s.weight_decay))
    lr_, wd = cast[g.dtype]
    d = -g if maximize else g
    if use_decay:
        d = d + wd * p
    if not s.momentum:
        return -lr_ * d, None
    # torch.optim.SGD starts the buffer at the first gradient, undamped.
    first = torch.as_tensor(s.first)
    buf = torch.where(first, d, s.momentum * buf + (1 - s.dampening) * d)
    d = d + s.momentum * buf if nesterov else buf
    return -lr_ * d, buf


Leaves = Sequence[Tensor]


def sgd_reference(
    grads: Leaves, params: Leaves, bufs: Sequence[Tensor | None], decay: Sequence[bool],
    s: SGDScalars, *, nesterov: bool = False, maximize: bool = False, write_params: bool = False,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """:func:`sgd_leaf` over lists: ``(out, b')``, ``out`` the updates or ``p + u``.

    Differentiable. Where :func:`funcpar.kernels.multi_tensor.multi_tensor_ok` allows (eager,
    outside torch.func transforms, one dtype per leaf), the same ops by multi-tensor ops
    (:func:`_sgd_multi`, the same bits); else per leaf."""
    if multi_tensor_ok(grads, params, bufs if s.momentum else [None] * len(grads)):
        return _sgd_multi(grads, params, bufs, decay, s, nesterov=nesterov, maximize=maximize,
                          write_params=write_params)
    outs, new_bufs = [], []
    cast: dict[torch.dtype, tuple[Tensor, Tensor]] = {}
    for g, p, b, dec in zip(grads, params, bufs, decay, strict=True):
        u, b = sgd_leaf(g, p, b, dec, s, nesterov=nesterov, maximize=maximize, cast=cast)
        outs.append((p + (u if u.dtype == p.dtype else u.to(p.dtype))) if write_params else u)
        new_bufs.append(b)
    return outs, new_bufs


def _sgd_multi(
    grads: Leaves, params: Leaves, bufs: Sequence[Tensor | None], decay: Sequence[bool],
    s: SGDScalars, *, nesterov: bool, maximize: bool, write_params: bool,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """:func:`sgd_leaf`'s ops in its order, each as one out-of-place multi-tensor op over all
    leaves (differentiable; funcpar.kernels.multi_tensor), the scalars cast once per dtype:
    the same values bit for bit."""
    wd, neg_lr = per_dtype([g.dtype for g in grads], _t(s.weight_decay), -_t(s.lr))
    d = add_scaled(torch._foreach_neg(grads) if maximize else grads, params, wd, decay)
    new_bufs: list[Tensor | None] = [None] * len(grads)
    if s.momentum:
        # torch.optim.SGD starts the buffer at the first d, undamped: a select per leaf (the
        # flag is a tensor of the state, not read on the host).
        first = torch.as_tensor(s.first)
        later = torch._foreach_add(torch._foreach_mul(list(bufs), s.momentum),
                                   torch._foreach_mul(d, 1 - s.dampening))
        new_bufs = [torch.where(first, di, li) for di, li in zip(d, later, strict=True)]
        d = (list(torch._foreach_add(d, torch._foreach_mul(new_bufs, s.momentum))) if nesterov
             else list(new_bufs))
    u = torch._foreach_mul(d, neg_lr)
    return list(torch._foreach_add(list(params), u) if write_params else u), new_bufs


# torch's CPU fused SGD (torch.optim.SGD(fused=True), torch 2.13) is wrong in bfloat16 and
# float16: 3 steps of N(0, 1) leaves at lr 0.1 land 1.1-2.1 away from a float64 run, where the
# foreach path (and funcpar's reference) stays within 0.02. Those dtypes take the multi-tensor
# path; float32 and float64 match the reference to round-off.
_FUSED_SGD_DTYPES = (torch.float32, torch.float64)


def sgd_fast(
    grads: Leaves, params: Leaves, bufs: Sequence[Tensor | None], decay: Sequence[bool],
    s: SGDScalars, *, nesterov: bool = False, maximize: bool = False, write_params: bool = False,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """:func:`sgd_reference` by multi-tensor ops (every leaf's tensors of one dtype): the
    buffers (and params with ``write_params``) in place inside
    :func:`funcpar.kernels.inplace.inplace_updates`, else in clones; the same operations in the
    same order as :func:`sgd_leaf`, so the bits are the reference's.

    Writing the parameters (``apply``) on CPU with contiguous leaves
    (:func:`funcpar.kernels.inplace.fused_leaves_ok`), torch's own fused kernel instead
    (:func:`_sgd_fused`), which rounds the new parameter as one fused multiply-add: ``apply``
    then equals ``update`` + ``apply_updates`` (and the reference) to round-off."""
    if write_params and fused_leaves_ok(grads, params, bufs if s.momentum else [None] * len(grads),
                                        dtypes=_FUSED_SGD_DTYPES):
        return _sgd_fused(grads, params, bufs, decay, s, nesterov=nesterov, maximize=maximize)
    dts = [g.dtype for g in grads]
    # The hyperparameters in each leaf's dtype, one 0-d tensor per dtype.
    cast = {dt: (_t(s.weight_decay).to(dt), -_t(s.lr).to(dt)) for dt in set(dts)}
    d = list(torch._foreach_neg(grads)) if maximize else list(grads)
    # A weight decay of 0 adds nothing (torch.optim.SGD skips it; the reference adds 0 * p,
    # which differs only where p is not finite). Read as a number: this path is never traced.
    no_decay = float(s.weight_decay) == 0
    ids = [] if no_decay else [i for i, dec in enumerate(decay) if dec]
    if ids:
        wd = torch._foreach_mul([params[i] for i in ids], [cast[dts[i]][0] for i in ids])
        for i, x in zip(ids, torch._foreach_add([d[i] for i in ids], wd), strict=True):
            d[i] = x
    new_bufs: list[Tensor | None] = list(bufs)
    if s.momentum:
        new_bufs = writable(bufs)
        if bool(s.first):  # torch.optim.SGD starts the buffer at the first d, undamped
            torch._foreach_copy_(new_bufs, d)
        else:
            torch._foreach_mul_(new_bufs, s.momentum)
            # (1 - 0) * d is d exactly: no temporary without dampening.
            torch._foreach_add_(new_bufs, torch._foreach_mul(d, 1 - s.dampening)
                                if s.dampening else d)
        if nesterov:
            d = torch._foreach_add(d, torch._foreach_mul(new_bufs, s.momentum))
        else:
            d = new_bufs
    u = torch._foreach_mul(d, [cast[dt][1] for dt in dts])
    if not write_params:
        return list(u), new_bufs
    out = writable(params)
    torch._foreach_add_(out, u)
    return out, new_bufs


def _sgd_fused(
    grads: Leaves, params: Leaves, bufs: Sequence[Tensor | None], decay: Sequence[bool],
    s: SGDScalars, *, nesterov: bool, maximize: bool,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """The step by ``torch._fused_sgd_`` (what ``torch.optim.SGD(fused=True)`` runs) on
    :func:`writable` buffers: per element ``d = g [+ wd p]``, ``b' = d`` on the first step else
    ``mu b + (1 - dampening) d``, ``p' = p - lr (d + mu b')`` (Nesterov) or ``p - lr b'``,
    with the last product and sum rounded once where the CPU has fused multiply-adds. Leaves
    without decay go in a call of their own with ``weight_decay=0``."""
    p = writable(params)
    b = writable(bufs) if s.momentum else list(bufs)
    (dp, bp), (db, bb), (dg, _) = dense(p), dense(b if s.momentum else []), dense(grads)
    # Hyperparameters as Python floats and the first-step flag as a bool: read on the host,
    # which this eager CPU path may do (it is never traced, sgd_step).
    lr, wd = float(s.lr), float(s.weight_decay)
    for weight_decay, ids in decay_calls(decay, wd):
        torch._fused_sgd_(
            [dp[i] for i in ids], [dg[i] for i in ids],
            [db[i] for i in ids] if s.momentum else [], weight_decay=weight_decay,
            momentum=s.momentum, lr=lr, dampening=s.dampening, nesterov=nesterov,
            maximize=maximize, is_first_step=bool(s.first))
    write_back([*bp, *bb])
    return p, b


def _fast_ok(grads: Leaves, params: Leaves, bufs: Sequence[Tensor | None], s: SGDScalars) -> bool:
    """One dtype per leaf (the reference's promotions are not reproduced), plain eager torch
    (no autograd, no torch.func transform, not traced: the first-step flag is read)."""
    if not grads or torch.compiler.is_compiling():
        return False
    for g, p, b in zip(grads, params, bufs, strict=True):
        if p.dtype != g.dtype or (s.momentum and b.dtype != g.dtype) or g.is_complex():
            return False
    return fast_path_ok(*grads, *params, *(bufs if s.momentum else ()), *s)


def _build():
    global tl, triton, tile_of, full_tile, leaf_load, leaf_store, param_load, update_store
    global sgd_tile
    import triton
    import triton.language as tl

    tile_of = _launch.leaf_tile()
    full_tile, leaf_load, leaf_store, param_load, update_store = _access.access()

    @triton.jit
    @no_type_check
    def sgd_tile(row, offs, n, dflag, scal, P: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
                 BO: tl.constexpr, U: tl.constexpr, MOMENTUM: tl.constexpr,
                 NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, WRITE_PARAMS: tl.constexpr,
                 FULL: tl.constexpr):
        # Leaf row: numel, decay flag, p, g, b (in), out, b (out). dflag 1: weight decay.
        mask = offs < n
        lr = tl.load(scal)
        wd = tl.load(scal + 1)
        g = leaf_load(row, 3, offs, mask, G, FULL).to(tl.float32)
        d = -g if MAXIMIZE else g
        p = param_load(row, 2, offs, mask, dflag, g, P, WRITE_PARAMS, FULL)
        d = tl.where(dflag != 0, d + wd * p, d)
        if MOMENTUM:
            mu = tl.load(scal + 2)
            damp1 = tl.load(scal + 3)  # 1 - dampening
            first = tl.load(scal + 4) != 0
            b = leaf_load(row, 4, offs, mask, B, FULL).to(tl.float32)
            b = tl.where(first, d, mu * b + damp1 * d).to(BO)
            leaf_store(row, 6, offs, b, mask, BO, FULL)
            b = b.to(tl.float32)
            if NESTEROV:
                d = d + mu * b
            else:
                d = b
        update_store(row, 5, offs, p, -lr * d, mask, P, U, WRITE_PARAMS, FULL)

    @triton.jit
    @no_type_check
    def sgd_kernel(table, tiles, scal, NCOL: tl.constexpr, BLOCK: tl.constexpr,
                   P: tl.constexpr, G: tl.constexpr, B: tl.constexpr, BO: tl.constexpr,
                   U: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                   MAXIMIZE: tl.constexpr, WRITE_PARAMS: tl.constexpr, ALIGNED: tl.constexpr):
        pid, _leaf, row, offs, n, dflag = tile_of(table, tiles, NCOL, BLOCK)
        # The same body compiled twice: 16-byte accesses on full tiles (funcpar.kernels._access).
        if full_tile(tiles, pid, n, BLOCK, ALIGNED):
            sgd_tile(row, offs, n, dflag, scal, P, G, B, BO, U, MOMENTUM, NESTEROV, MAXIMIZE,
                     WRITE_PARAMS, True)
        else:
            sgd_tile(row, offs, n, dflag, scal, P, G, B, BO, U, MOMENTUM, NESTEROV, MAXIMIZE,
                     WRITE_PARAMS, False)

    return sgd_kernel


_kernel = _launch.lazy_kernels(_build)


def sgd_triton(
    grads: Leaves, params: Leaves, bufs: Sequence[Tensor | None], decay: Sequence[bool],
    s: SGDScalars, *, nesterov: bool = False, maximize: bool = False, write_params: bool = False,
    block: int | None = None,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """:func:`sgd_reference` by the Triton kernel, one launch per device and dtype group."""
    block = block or _launch.BLOCK
    momentum = bool(s.momentum)
    n = len(grads)
    outs: list = [None] * n
    new_bufs: list = [None] * n
    groups = _launch.group_by(n, lambda i: (grads[i].device, grads[i].dtype, params[i].dtype,
                                            bufs[i].dtype if momentum else None))
    for (device, gd, pd, bd), idx in groups.items():
        bo = torch.promote_types(bd, gd) if momentum else gd
        ud = torch.promote_types(torch.promote_types(gd, pd), bo)
        group = _launch.LeafGroup(device, block)
        for i in idx:
            g, p = grads[i].contiguous(), params[i].contiguous()
            b = bufs[i].contiguous() if momentum else None
            # Donated (inplace_updates): into p and b themselves where the dtypes allow.
            outs[i] = (_launch.output_into(p, pd) if write_params
                       else _launch.new_output(p.shape, ud, device))
            new_bufs[i] = _launch.output_into(b, bo) if momentum else None
            # Leaf row: numel, decay flag, p, g, b (in), out, b (out).
            group.add(i, decay[i], p, g, b, outs[i], new_bufs[i])
        if not group:
            continue
        first = s.first if torch.is_tensor(s.first) else torch.tensor(bool(s.first))
        scal = _launch.device_scalars(
            [s.lr, s.weight_decay, s.momentum, 1 - s.dampening, first], device)
        T = _launch.tl_dtype
        group.launch(_kernel(), scal, P=T(pd), G=T(gd), B=T(bd or gd), BO=T(bo), U=T(ud),
                     MOMENTUM=momentum, NESTEROV=nesterov, MAXIMIZE=maximize,
                     WRITE_PARAMS=write_params, ALIGNED=group.aligned)
    return outs, new_bufs


def sgd_step(
    grads: Leaves, params: Leaves, bufs: Sequence[Tensor | None], decay: Sequence[bool],
    s: SGDScalars, *, nesterov: bool = False, maximize: bool = False, write_params: bool = False,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """The kernel when :func:`funcpar.kernels.use_kernels` says so and every tensor has a
    kernel dtype, else the reference."""
    tensors = [*grads, *params, *(bufs if s.momentum else ())]
    if _launch.kernels_apply(*tensors, hyper=s):
        impl = sgd_triton
    elif _fast_ok(grads, params, bufs, s):
        impl = sgd_fast  # multi-tensor plain torch; steps aside for autograd and vmap
    else:
        impl = sgd_reference
    return impl(grads, params, bufs, decay, s, nesterov=nesterov, maximize=maximize,
                write_params=write_params)
