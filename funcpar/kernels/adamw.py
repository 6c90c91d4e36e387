"""Fused AdamW step: the plain-torch reference, the multi-tensor Triton kernel, the dispatch.

Per element, with ``g`` the gradient (negated with ``maximize``) and the scalars of the step
(``step_size = lr / (1 - b1^t)``, ``bc2_sqrt = sqrt(1 - b2^t)``, ``lr_wd = lr * weight_decay``):

``m' = lerp(m, g, 1 - b1)``, ``v' = b2 v + (1 - b2) g^2``, ``vmax' = max(vmax, v')`` (amsgrad),
``u = -step_size * m' / (sqrt(v' or vmax') / bc2_sqrt + eps) [- lr_wd * p]``,
and ``p' = p + u`` (:func:`adamw_step` with ``write_params=True``) or ``u`` itself.
On CPU with ``write_params`` the fast path is torch's fused kernel, which rounds
``p' = p (1 - lr_wd) - step_size m' / denom`` as one expression (:func:`adamw_fast`).

``eps_root`` (optax's and torchopt's, default 0) goes inside the square root:
``sqrt(v_hat + eps_root)`` with ``v_hat = v' / (1 - b2^t)``, computed as
``sqrt(v' + eps_root bc2_sqrt^2) / bc2_sqrt`` so that ``eps_root = 0`` is the same ops and bits
as without it. It keeps ``d sqrt / dv`` finite where ``v = 0`` (a dead unit's zero gradient),
which differentiating through the step needs. Only the reference computes it: a step with
``eps_root != 0`` never takes the Triton kernel or the fused / multi-tensor fast paths.

Bytes per parameter (fp32 everything): ``p`` read and written, ``g`` read, ``m`` and ``v`` read
and written: 28 B (36 B with amsgrad); returning ``u`` instead writes ``u`` and does not read
``p`` on leaves without decay (24 B), and adding it later costs 12 B more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, no_type_check

import torch
from torch import Tensor

from funcpar.kernels import _access, _launch
from funcpar.kernels.inplace import (
    copies,
    decay_calls,
    dense,
    fast_path_ok,
    fused_leaves_ok,
    writable,
    write_back,
)
from funcpar.kernels.members import member_scalars, on_members
from funcpar.kernels.multi_tensor import add_scaled, in_dtype, multi_tensor_ok, per_dtype

__all__ = [
    "AdamWScalars", "adamw_fast", "adamw_leaf", "adamw_reference", "adamw_step", "adamw_triton",
    "with_bias_terms",
]


class AdamWScalars(NamedTuple):
    """The step's scalars: 0-d float64 tensors (or floats) and the static betas; ``lr``,
    ``weight_decay`` and ``count`` (the step ``t``, from 1), when given, are the raw values
    torch's fused kernel derives the others from (:func:`adamw_fast` takes it only then).
    ``step_size`` and ``bc2_sqrt`` may be ``None`` when ``lr`` and ``count`` are given, and
    ``lr_wd`` when ``lr`` and ``weight_decay`` are: the paths that read them derive them
    (:func:`with_bias_terms`); the fused kernel does not."""

    step_size: Tensor | float | None  # lr / (1 - b1^t)
    bc2_sqrt: Tensor | float | None  # sqrt(1 - b2^t)
    eps: Tensor | float
    lr_wd: Tensor | float | None  # lr * weight_decay
    beta1: float
    beta2: float
    lr: Tensor | float | None = None
    weight_decay: Tensor | float | None = None
    count: Tensor | int | None = None
    eps_root: float = 0.0  # a number: it decides the path (module doc)


def with_bias_terms(s: AdamWScalars) -> AdamWScalars:
    """``s`` with ``step_size = lr / (1 - b1^t)``, ``bc2_sqrt = sqrt(1 - b2^t)`` and ``lr_wd =
    lr * weight_decay`` filled in from ``lr``, ``count`` and ``weight_decay`` where they are
    ``None`` (0-d float64 tensor operations, as torch.optim.AdamW's capturable path forms them:
    differentiable in ``lr``, batched under vmap, traced under compile). Computed only on the
    paths that read them: torch's fused CPU kernel derives its own from ``lr``, ``t`` and the
    decay, and these 0-d operations were a fifth of a small donated step's host time."""
    if s.lr_wd is None:
        if s.lr is None or s.weight_decay is None:
            raise ValueError("AdamWScalars: lr_wd is None, so lr and weight_decay are needed "
                             "to derive it")
        s = s._replace(lr_wd=s.lr * s.weight_decay)
    if s.step_size is not None and s.bc2_sqrt is not None:
        return s
    if s.lr is None or s.count is None:
        raise ValueError("AdamWScalars: step_size and bc2_sqrt are None, so lr and count are "
                         "needed to derive them")
    t = _t(s.count).to(torch.float64)
    return s._replace(step_size=s.lr / (1 - s.beta1**t), bc2_sqrt=(1 - s.beta2**t).sqrt())


def _t(x: Tensor | float) -> Tensor:
    return x if torch.is_tensor(x) else torch.tensor(float(x), dtype=torch.float64)


def adamw_leaf(
    g: Tensor, p: Tensor, m: Tensor, v: Tensor, vmax: Tensor | None, use_decay: bool,
    s: AdamWScalars, *, amsgrad: bool, maximize: bool,
    cast: dict[torch.dtype, tuple[Tensor, ...]] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The reference for one leaf: ``(u, m', v', vmax')`` exactly as torch.optim.AdamW.
    ``cast``, when given, caches the step's scalars per dtype across a loop over leaves."""
    s = with_bias_terms(s)
    if maximize:
        g = -g
    # Low-precision gradients with float32 states: the arithmetic in the states' precision.
    if g.dtype != m.dtype:
        g = g.to(torch.promote_types(g.dtype, m.dtype))
    m = torch.lerp(m, g, 1 - s.beta1)
    v = v * s.beta2 + (1 - s.beta2) * g * g
    if amsgrad:
        vmax = torch.maximum(vmax, v)
    # Hyperparameters in the leaf's dtype: a 0-d float64 scalar would otherwise promote a 0-d
    # float32 leaf to float64.
    dt = g.dtype
    cast = {} if cast is None else cast
    if dt not in cast:
        cast[dt] = in_dtype(dt, _t(s.bc2_sqrt), _t(s.eps), -_t(s.step_size), _t(s.lr_wd))
    bc2_sqrt, eps, neg_step_size, lr_wd = cast[dt]
    denom = (_with_eps_root(vmax if amsgrad else v, bc2_sqrt, s.eps_root).sqrt()
             / bc2_sqrt) + eps
    u = neg_step_size * (m / denom)
    if use_decay:
        u = u - lr_wd * p
    return u, m, v, vmax


def _with_eps_root(v: Tensor, bc2_sqrt: Tensor, eps_root: float) -> Tensor:
    """``v + eps_root bc2_sqrt^2`` (module doc); ``v`` itself when ``eps_root`` is 0."""
    return v + eps_root * (bc2_sqrt * bc2_sqrt) if eps_root else v


Leaves = Sequence[Tensor]
Out = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor | None]]


def _adamw_foreach(grads: Leaves, params: Leaves, m: list, v: list, vmax: list,
                   decay: Sequence[bool], s: AdamWScalars, *, amsgrad: bool, maximize: bool,
                   write_params: bool) -> list[Tensor]:
    """:func:`adamw_leaf`'s maths with multi-tensor ops, ``m``/``v``/``vmax`` (and ``params``
    with ``write_params``) updated in place; returns the updates or the new parameters."""
    g = [x.to(torch.promote_types(x.dtype, mi.dtype)) for x, mi in zip(grads, m, strict=True)]
    if maximize:
        g = torch._foreach_neg(g)
    torch._foreach_lerp_(m, g, 1 - s.beta1)
    torch._foreach_mul_(v, s.beta2)
    torch._foreach_addcmul_(v, g, g, 1 - s.beta2)
    if amsgrad:
        torch._foreach_maximum_(vmax, v)
    denom = torch._foreach_sqrt(vmax if amsgrad else v)
    dts = [x.dtype for x in g]
    # Hyperparameters in each leaf's dtype, as the per-leaf reference has them (one 0-d tensor
    # per dtype, not per leaf).
    cast = {dt: (_t(s.bc2_sqrt).to(dt), _t(s.eps).to(dt), -_t(s.step_size).to(dt))
            for dt in set(dts)}
    torch._foreach_div_(denom, [cast[dt][0] for dt in dts])
    torch._foreach_add_(denom, [cast[dt][1] for dt in dts])
    # u = m / denom written over denom: fresh leaf-sized allocations (page faults) cost more
    # than the arithmetic on CPU.
    u = denom
    for mi, ui in zip(m, u, strict=True):
        torch.div(mi, ui, out=ui)
    torch._foreach_mul_(u, [cast[dt][2] for dt in dts])
    # A decay of 0 is skipped (the reference's u - 0 p differs only where p is not finite).
    ids = [i for i, d in enumerate(decay) if d] if float(s.lr_wd) else []
    if ids:
        # u - lr_wd p without a leaf-sized temporary (alpha: a number; never traced, see
        # adamw_step). May round once where the reference rounds twice (a fused multiply-add).
        torch._foreach_add_([u[i] for i in ids], [params[i] for i in ids],
                            alpha=-float(s.lr_wd))
    if not write_params:
        return list(u)
    torch._foreach_add_(params, [x.to(p.dtype) for x, p in zip(u, params, strict=True)])
    return list(params)


def adamw_fast(
    grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
    max_exp_avg_sq: Sequence[Tensor | None], decay: Sequence[bool], s: AdamWScalars, *,
    amsgrad: bool = False, maximize: bool = False, write_params: bool = False,
) -> Out:
    """:func:`adamw_reference` by torch's fused or multi-tensor ops: in place on the inputs
    inside :func:`funcpar.kernels.inplace.inplace_updates`, else on clones (one maths path, so
    donated and undonated results are bit-identical).

    Writing the parameters (``apply``) on CPU, torch's own fused kernel
    (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)`` runs) when
    :func:`_fused_ok` allows: one pass over ``p, g, m, v``, no temporaries. It rounds the new
    parameter its own way (``p (1 - lr wd) - step_size m / denom`` in one expression), so
    ``apply`` equals ``update`` + ``apply_updates`` to round-off, not bit for bit
    (funcpar.optim.base). Returning the updates (``update``), multi-tensor ops."""
    if write_params and _fused_ok(grads, params, exp_avg, exp_avg_sq, max_exp_avg_sq, s,
                                  amsgrad=amsgrad):
        return _adamw_fused(grads, params, exp_avg, exp_avg_sq, max_exp_avg_sq, decay, s,
                            amsgrad=amsgrad, maximize=maximize)
    s = with_bias_terms(s)
    # Promoted states (a bf16 m with float32 grads) cannot be written in place: clone-promote.
    m = [x if x.dtype == torch.promote_types(x.dtype, g.dtype) else x.to(g.dtype)
         for x, g in zip(writable(exp_avg), grads, strict=True)]
    v = [x if x.dtype == torch.promote_types(x.dtype, g.dtype) else x.to(g.dtype)
         for x, g in zip(writable(exp_avg_sq), grads, strict=True)]
    vmax = writable(max_exp_avg_sq) if amsgrad else list(max_exp_avg_sq)
    p = writable(params) if write_params else list(params)
    if not write_params:  # every update is returned: all of them live at once anyway
        out = _adamw_foreach(grads, p, m, v, vmax, decay, s, amsgrad=amsgrad,
                             maximize=maximize, write_params=False)
        return out, m, v, vmax
    # Writing the parameters, each group's updates are spent before the next group's exist:
    # groups of at most the largest leaf's size keep the step's temporary (sqrt(v), then u) at
    # one large leaf, as a per-leaf loop would (all leaves at once: ~4 B/param more at the
    # peak, measured by benchmarks/bench_memory.py). Elementwise maths: the same bits.
    for ids in _groups([x.numel() for x in p]):
        pick = [grads, p, m, v, vmax, decay]
        _adamw_foreach(*([xs[i] for i in ids] for xs in pick), s, amsgrad=amsgrad,
                       maximize=maximize, write_params=True)
    return p, m, v, vmax


def _fused_ok(grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
              max_exp_avg_sq: Sequence[Tensor | None], s: AdamWScalars, *,
              amsgrad: bool) -> bool:
    """``torch._fused_adamw_`` computes this step: the raw ``lr``, ``weight_decay`` and
    ``count`` are known, the count is exact in the float32 step tensor the kernel reads (every
    member's, for vmap's ``(n,)`` counts), and the leaves pass :func:`fused_leaves_ok`."""
    if s.lr is None or s.weight_decay is None or s.count is None:
        return False
    if isinstance(s.count, Tensor) and s.count.dim():
        lo, hi = int(s.count.min()), int(s.count.max())
    else:
        lo = hi = int(s.count)
    if not 1 <= lo <= hi <= 2**24:
        return False
    return fused_leaves_ok(grads, params, exp_avg, exp_avg_sq,
                           max_exp_avg_sq if amsgrad else [None] * len(grads))


def _adamw_fused(grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
                 max_exp_avg_sq: Sequence[Tensor | None], decay: Sequence[bool],
                 s: AdamWScalars, *, amsgrad: bool, maximize: bool,
                 members: int | None = None) -> Out:
    """The step by ``torch._fused_adamw_`` on :func:`writable` buffers: per element
    ``p' = p (1 - lr wd) - step_size m' / (sqrt(v' or vmax') / bc2_sqrt + eps)`` with ``m'``,
    ``v'``, ``vmax'`` as :func:`adamw_leaf`; ``step_size`` and ``bc2_sqrt`` computed by the
    kernel in float64 from ``lr`` and ``t`` exactly as torch.optim.AdamW. Leaves without decay
    go in a call of their own with ``weight_decay=0`` (the kernel then skips the decay).
    Gradients are only read (no ``grad_scale``: the kernel would write the unscaled ones).

    ``members``: the leaves are vmap's ``(members, ...)`` tensors
    (:func:`funcpar.kernels.members.on_members`) and ``count``, ``lr``, ``weight_decay`` and
    ``eps`` may hold one value per member: each member's slices get the call a step of that
    member alone makes, in copies (the inputs are the state's storage)."""
    own = writable if members is None else copies
    p, m, v = own(params), own(exp_avg), own(exp_avg_sq)
    vmax = own(max_exp_avg_sq) if amsgrad else list(max_exp_avg_sq)
    (dp, bp), (dm, bm), (dv, bv) = dense(p), dense(m), dense(v)
    (dx, bx), (dg, _) = dense(vmax if amsgrad else []), dense(grads)
    # The kernel reads the step as float32 (exact up to 2^24, _fused_ok) and the hyper-
    # parameters as Python floats: this path runs eagerly on CPU, never traced.
    rows = member_scalars(1 if members is None else members, s.count, s.lr, s.weight_decay,
                          s.eps)
    steps = ([torch.scalar_tensor(rows[0][0], dtype=torch.float32)] if members is None
             else torch.tensor([r[0] for r in rows], dtype=torch.float32).unbind())
    if members is not None:  # each leaf's member slices, cut once (an index is ~2 us a slice)
        dp, dg, dm, dv, dx = ([x.unbind() for x in xs] for xs in (dp, dg, dm, dv, dx))
    for i, ((_, lr, wd, eps), step) in enumerate(zip(rows, steps, strict=True)):
        member = None if members is None else i
        for weight_decay, ids in decay_calls(decay, wd):
            torch._fused_adamw_(
                _take(dp, ids, member), _take(dg, ids, member), _take(dm, ids, member),
                _take(dv, ids, member), _take(dx, ids, member) if amsgrad else [],
                [step] * len(ids), lr=lr, beta1=s.beta1, beta2=s.beta2,
                weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize)
    write_back([*bp, *bm, *bv, *bx])
    return p, m, v, vmax


def _take(xs: Sequence[Any], ids: Sequence[int], member: int | None) -> list[Tensor]:
    # The leaves ids of xs, or member's slices of them (xs: each leaf's slices).
    return [xs[j] for j in ids] if member is None else [xs[j][member] for j in ids]


def _adamw_members(grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
                   max_exp_avg_sq: Sequence[Tensor | None], decay: Sequence[bool],
                   s: AdamWScalars, *, amsgrad: bool, maximize: bool) -> Out | None:
    """:func:`_adamw_fused` on the members' ``(n, ...)`` tensors (vmap_step's update, given by
    :func:`funcpar.kernels.members.on_members`), where the fused kernel can run; else
    ``None``."""
    if not _fused_ok(grads, params, exp_avg, exp_avg_sq, max_exp_avg_sq, s, amsgrad=amsgrad):
        return None
    return _adamw_fused(grads, params, exp_avg, exp_avg_sq, max_exp_avg_sq, decay, s,
                        amsgrad=amsgrad, maximize=maximize, members=grads[0].shape[0])


def _groups(sizes: Sequence[int]) -> list[list[int]]:
    """Consecutive indices grouped so that no group's total exceeds ``max(sizes)``."""
    budget = max(sizes, default=0)
    groups: list[list[int]] = []
    total = budget + 1
    for i, n in enumerate(sizes):
        if total + n > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def adamw_reference(
    grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
    max_exp_avg_sq: Sequence[Tensor | None], decay: Sequence[bool], s: AdamWScalars, *,
    amsgrad: bool = False, maximize: bool = False, write_params: bool = False,
) -> Out:
    """:func:`adamw_leaf` over lists of leaves: ``(out, m', v', vmax')`` with ``out`` the
    updates, or the new parameters ``p + u`` (in ``p``'s dtype) with ``write_params``.

    Differentiable. Where :func:`funcpar.kernels.multi_tensor.multi_tensor_ok` allows (eager,
    outside torch.func transforms, one dtype per leaf), the same ops by multi-tensor ops
    (:func:`_adamw_multi`, the same bits); else per leaf."""
    s = with_bias_terms(s)
    if multi_tensor_ok(grads, params, exp_avg, exp_avg_sq,
                       max_exp_avg_sq if amsgrad else [None] * len(grads)):
        return _adamw_multi(grads, params, exp_avg, exp_avg_sq, max_exp_avg_sq, decay, s,
                            amsgrad=amsgrad, maximize=maximize, write_params=write_params)
    outs, ms, vs, vmaxs = [], [], [], []
    cast: dict[torch.dtype, tuple[Tensor, ...]] = {}
    for g, p, m, v, vmax, dec in zip(grads, params, exp_avg, exp_avg_sq, max_exp_avg_sq, decay,
                                     strict=True):
        u, m, v, vmax = adamw_leaf(g, p, m, v, vmax, dec, s, amsgrad=amsgrad, maximize=maximize,
                                   cast=cast)
        outs.append((p + (u if u.dtype == p.dtype else u.to(p.dtype))) if write_params else u)
        ms.append(m)
        vs.append(v)
        vmaxs.append(vmax)
    return outs, ms, vs, vmaxs


def _adamw_multi(
    grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
    max_exp_avg_sq: Sequence[Tensor | None], decay: Sequence[bool], s: AdamWScalars, *,
    amsgrad: bool, maximize: bool, write_params: bool,
) -> Out:
    """:func:`adamw_leaf`'s ops in its order, each as one out-of-place multi-tensor op over
    all leaves (differentiable, one autograd node per op; funcpar.kernels.multi_tensor), the
    scalars cast once per dtype: the same values bit for bit."""
    g = torch._foreach_neg(grads) if maximize else list(grads)
    m = torch._foreach_lerp(list(exp_avg), g, 1 - s.beta1)
    # v b2 + ((1 - b2) g) g, as the reference rounds it.
    v = torch._foreach_add(torch._foreach_mul(list(exp_avg_sq), s.beta2),
                           torch._foreach_mul(torch._foreach_mul(g, 1 - s.beta2), g))
    vmax = (list(torch._foreach_maximum(list(max_exp_avg_sq), v)) if amsgrad
            else list(max_exp_avg_sq))
    bc2, eps, step, lr_wd = per_dtype([x.dtype for x in g], _t(s.bc2_sqrt), _t(s.eps),
                                      -_t(s.step_size), _t(s.lr_wd))
    second = vmax if amsgrad else v
    if s.eps_root:
        second = [_with_eps_root(x, b, s.eps_root) for x, b in zip(second, bc2, strict=True)]
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(second), bc2), eps)
    u = add_scaled(torch._foreach_mul(torch._foreach_div(m, denom), step), params, lr_wd, decay,
                   subtract=True)
    out = torch._foreach_add(list(params), u) if write_params else list(u)
    return list(out), list(m), list(v), vmax


def _build():
    global tl, triton, tile_of, full_tile, leaf_load, leaf_store, param_load, update_store
    global adamw_tile
    import triton
    import triton.language as tl

    tile_of = _launch.leaf_tile()
    full_tile, leaf_load, leaf_store, param_load, update_store = _access.access()

    @triton.jit
    @no_type_check
    def adamw_tile(row, offs, n, dflag, scal, P: tl.constexpr, G: tl.constexpr,
                   M: tl.constexpr, V: tl.constexpr, VM: tl.constexpr, MO: tl.constexpr,
                   VO: tl.constexpr, VMO: tl.constexpr, U: tl.constexpr, AMSGRAD: tl.constexpr,
                   MAXIMIZE: tl.constexpr, LERP_SMALL: tl.constexpr, WRITE_PARAMS: tl.constexpr,
                   FULL: tl.constexpr):
        # The leaf's row of the table holds numel, the decay flag (1: weight decay applies)
        # and the addresses of p, g, m, v, vmax (in), then out, m', v', vmax'.
        mask = offs < n
        step_size = tl.load(scal)
        bc2_sqrt = tl.load(scal + 1)
        eps = tl.load(scal + 2)
        lr_wd = tl.load(scal + 3)
        w1 = tl.load(scal + 4)  # 1 - beta1, the lerp weight
        beta2 = tl.load(scal + 5)
        c2 = tl.load(scal + 6)  # 1 - beta2

        g = leaf_load(row, 3, offs, mask, G, FULL).to(tl.float32)
        if MAXIMIZE:
            g = -g
        m = leaf_load(row, 4, offs, mask, M, FULL).to(tl.float32)
        v = leaf_load(row, 5, offs, mask, V, FULL).to(tl.float32)
        # torch.lerp's two forms (exact at either end), as fused multiply-adds like torch's.
        if LERP_SMALL:
            m = tl.fma(w1, g - m, m)
        else:
            m = tl.fma(w1 - 1.0, g - m, g)
        v = v * beta2 + (c2 * g) * g
        # The update uses the states as stored (rounded to a bf16 state's dtype, say).
        m = m.to(MO).to(tl.float32)
        v = v.to(VO).to(tl.float32)
        leaf_store(row, 8, offs, m, mask, MO, FULL)
        leaf_store(row, 9, offs, v, mask, VO, FULL)
        if AMSGRAD:
            vm = leaf_load(row, 6, offs, mask, VM, FULL).to(tl.float32)
            v = tl.maximum(vm, v).to(VMO).to(tl.float32)
            leaf_store(row, 10, offs, v, mask, VMO, FULL)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        u = -step_size * tl.div_rn(m, denom)
        p = param_load(row, 2, offs, mask, dflag, u, P, WRITE_PARAMS, FULL)
        u = tl.where(dflag != 0, u - lr_wd * p, u)
        update_store(row, 7, offs, p, u, mask, P, U, WRITE_PARAMS, FULL)

    @triton.jit
    @no_type_check
    def adamw_kernel(table, tiles, scal, NCOL: tl.constexpr, BLOCK: tl.constexpr,
                     P: tl.constexpr, G: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                     VM: tl.constexpr, MO: tl.constexpr, VO: tl.constexpr, VMO: tl.constexpr,
                     U: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                     LERP_SMALL: tl.constexpr, WRITE_PARAMS: tl.constexpr,
                     ALIGNED: tl.constexpr):
        # Program i: tile tiles[i, 1] of leaf tiles[i, 0]; the same body compiled twice,
        # with 16-byte accesses on full tiles (funcpar.kernels._access).
        pid, _leaf, row, offs, n, dflag = tile_of(table, tiles, NCOL, BLOCK)
        if full_tile(tiles, pid, n, BLOCK, ALIGNED):
            adamw_tile(row, offs, n, dflag, scal, P, G, M, V, VM, MO, VO, VMO, U, AMSGRAD,
                       MAXIMIZE, LERP_SMALL, WRITE_PARAMS, True)
        else:
            adamw_tile(row, offs, n, dflag, scal, P, G, M, V, VM, MO, VO, VMO, U, AMSGRAD,
                       MAXIMIZE, LERP_SMALL, WRITE_PARAMS, False)

    return adamw_kernel


_kernel = _launch.lazy_kernels(_build)


def _promote(*dtypes: torch.dtype) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def adamw_triton(
    grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
    max_exp_avg_sq: Sequence[Tensor | None], decay: Sequence[bool], s: AdamWScalars, *,
    amsgrad: bool = False, maximize: bool = False, write_params: bool = False,
    block: int | None = None,
) -> Out:
    """:func:`adamw_reference` computed by the Triton kernel: one launch per group of leaves
    that share a device and dtypes. Every tensor must have a dtype of
    :data:`funcpar.kernels._launch.KERNEL_DTYPES`; the outputs have the reference's dtypes."""
    s = with_bias_terms(s)
    block = block or _launch.BLOCK
    n = len(grads)
    outs: list = [None] * n
    ms: list = [None] * n
    vs: list = [None] * n
    vmaxs: list = [None] * n
    groups = _launch.group_by(n, lambda i: (
        grads[i].device, grads[i].dtype, params[i].dtype, exp_avg[i].dtype, exp_avg_sq[i].dtype,
        max_exp_avg_sq[i].dtype if amsgrad else None))
    lerp_small = abs(1 - s.beta1) < 0.5
    for (device, gd, pd, md, vd, vmd), idx in groups.items():
        mo, vo = _promote(md, gd), _promote(vd, gd)
        vmo = _promote(vmd, vo) if amsgrad else vo
        ud = _promote(gd, mo, vmo, pd)
        group = _launch.LeafGroup(device, block)
        for i in idx:
            g, p = grads[i].contiguous(), params[i].contiguous()
            m, v = exp_avg[i].contiguous(), exp_avg_sq[i].contiguous()
            vm = max_exp_avg_sq[i].contiguous() if amsgrad else None
            shape = p.shape
            # Donated (inplace_updates): into p, m, v themselves where the dtypes allow.
            outs[i] = (_launch.output_into(p, pd) if write_params
                       else _launch.new_output(shape, ud, device))
            ms[i] = _launch.output_into(m, mo)
            vs[i] = _launch.output_into(v, vo)
            # Without amsgrad the (unused) state passes through, as in the reference.
            vmaxs[i] = _launch.output_into(vm, vmo) if amsgrad else max_exp_avg_sq[i]
            # Leaf row: numel, decay flag, p, g, m, v, vmax, out, m', v', vmax'.
            group.add(i, decay[i], p, g, m, v, vm, outs[i], ms[i], vs[i],
                      vmaxs[i] if amsgrad else None)
        if not group:
            continue
        scal = _launch.device_scalars(
            [s.step_size, s.bc2_sqrt, s.eps, s.lr_wd, 1 - s.beta1, s.beta2, 1 - s.beta2], device)
        T = _launch.tl_dtype
        group.launch(_kernel(), scal, P=T(pd), G=T(gd), M=T(md), V=T(vd),
                     VM=T(vmd if amsgrad else vd), MO=T(mo), VO=T(vo), VMO=T(vmo), U=T(ud),
                     AMSGRAD=amsgrad, MAXIMIZE=maximize, LERP_SMALL=lerp_small,
                     WRITE_PARAMS=write_params, ALIGNED=group.aligned)
    return outs, ms, vs, vmaxs


def adamw_step(
    grads: Leaves, params: Leaves, exp_avg: Leaves, exp_avg_sq: Leaves,
    max_exp_avg_sq: Sequence[Tensor | None], decay: Sequence[bool], s: AdamWScalars, *,
    amsgrad: bool = False, maximize: bool = False, write_params: bool = False,
) -> Out:
    """The kernel when :func:`funcpar.kernels.use_kernels` says so and every tensor has a
    kernel dtype, else the reference (float64 and complex leaves, CPU tensors by default,
    and any step with ``eps_root``)."""
    tensors = [*grads, *params, *exp_avg, *exp_avg_sq, *(max_exp_avg_sq if amsgrad else ())]
    if s.eps_root:  # only the reference computes it (module doc)
        impl = adamw_reference
    elif _launch.kernels_apply(*tensors, hyper=s):
        impl = adamw_triton
    elif grads and not torch.compiler.is_compiling() and fast_path_ok(*tensors, *s):
        impl = adamw_fast  # multi-tensor/fused plain torch; steps aside for autograd and vmap
    else:
        if write_params and grads:  # under vmap_step: the fused kernel member by member
            out = on_members(
                lambda g, p, m, v, vmax, scalars: _adamw_members(
                    g, p, m, v, vmax, decay, scalars, amsgrad=amsgrad, maximize=maximize),
                (grads, params, exp_avg, exp_avg_sq,
                 max_exp_avg_sq if amsgrad else [None] * len(grads)), s)
            if out is not None:
                return out
        impl = adamw_reference
    return impl(grads, params, exp_avg, exp_avg_sq, max_exp_avg_sq, decay, s, amsgrad=amsgrad,
                maximize=maximize, write_params=write_params)
