"""Lamb (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", arXiv 1904.00962): Adam moments with a layer-wise trust ratio.

The references disagree on almost every detail (bias correction, where weight decay enters,
clamping, an eps in the trust ratio); :func:`lamb` has one code path with an option for each
difference and a ``variant`` preset per reference, each tested step by step against it.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
from torch import Tensor

from funcpar.kernels import lamb as _lk
from funcpar.kernels.foreach_factored import host_equals
from funcpar.kernels.inplace import inplace_allowed
from funcpar.kernels.lamb import (
    LambScalars,
    lamb_direction,
    lamb_kernels_apply,
    lamb_moments_triton,
    lamb_update_triton,
)
from funcpar.optim import validate
from funcpar.optim.base import GradientTransformation, check_floating, checked_leaf_columns
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, mask_flags
from funcpar.optim.schedules import ScalarOrSchedule
from funcpar.shard.reduce import sum_partials
from funcpar.state.tree import Tree, tree_map, tree_unflatten

__all__ = ["LAMB_VARIANTS", "LambState", "lamb"]

#: The structural options each ``variant`` stands for (an explicit argument overrides one).
LAMB_VARIANTS: dict[str, dict] = {
    # The paper's Algorithm 2 with Adam's bias correction (as NVIDIA apex's FusedLAMB).
    "default": dict(bias_correction="moments", weight_decay_mode="in_update",
                    max_weight_norm=None, eps_in_trust_ratio=False, grad_averaging=True),
    # torch_optimizer.Lamb defaults (debias=False, clamp_value=10).
    "torch_optimizer": dict(bias_correction="none", weight_decay_mode="in_update",
                            max_weight_norm=10.0, eps_in_trust_ratio=False, grad_averaging=True),
    # pytorch_optimizer.Lamb defaults (weight_decouple=True, its class-level clamp = 10).
    "pytorch_optimizer": dict(bias_correction="step_size_m", weight_decay_mode="decoupled",
                              max_weight_norm=10.0, eps_in_trust_ratio=True, grad_averaging=True),
    # colossalai.nn.optimizer.DistributedLamb (bias_correction=True).
    "colossalai": dict(bias_correction="step_size", weight_decay_mode="in_update",
                       max_weight_norm=None, eps_in_trust_ratio=False, grad_averaging=True),
}


class LambState(NamedTuple):
    count: Tensor  # 0-d int64
    exp_avg: Tree
    exp_avg_sq: Tree
    # 0-d per leaf: the trust ratio of the last update, before ``adam`` replaces it by 1
    # (the references keep it in their state for the paper's histograms).
    trust_ratio: Tree


def _trust_ratio(w_norm, a_norm, eps, *, max_weight_norm, max_trust_ratio, eps_in_trust_ratio):
    """``||w|| / ||a||`` with the options (element-wise: one leaf's 0-d norms or many leaves')."""
    if max_weight_norm is not None:
        w_norm = w_norm.clamp(max=max_weight_norm)
    ratio = w_norm / ((a_norm + eps) if eps_in_trust_ratio else a_norm)
    # Both norms > 0 (NaN: neither) as one comparison of their minimum (NaN propagates): a
    # whole leaf's step runs these 0-d operations once per leaf, each costs about as much as
    # a pass over a small leaf.
    ratio = torch.where(torch.minimum(w_norm, a_norm) > 0, ratio, 1.0)
    if max_trust_ratio is not None:
        ratio = ratio.clamp(max=max_trust_ratio)
    return ratio


def _to_float32(x: float) -> float:
    return ctypes.c_float(x).value  # round to nearest even; beyond the range: +-inf


def _trust_ratio_host(w_norm: Tensor, a_norm: Tensor, eps, *, max_weight_norm,
                      max_trust_ratio, eps_in_trust_ratio) -> tuple[Tensor, float]:
    """:func:`_trust_ratio` of one leaf's 0-d float32 or float64 norms, as a 0-d tensor of the
    same value and dtype, and that value as a number: computed on the host (two reads and one
    0-d tensor for its six 0-d operations, which cost more than a small leaf's passes). A
    float32 operation is its float64 counterpart rounded once to float32 (exact for +, / and
    the clamps: a float64 sum or quotient of float32 numbers rounds to float32 as the float32
    operation does); a float64 ``eps`` tensor promotes as torch promotes 0-d tensors."""
    rnd = _to_float32 if w_norm.dtype == torch.float32 else float
    w, a = w_norm.item(), a_norm.item()
    if max_weight_norm is not None and w > rnd(max_weight_norm):  # clamp keeps a NaN
        w = rnd(max_weight_norm)
    dtype = w_norm.dtype
    if eps_in_trust_ratio and torch.is_tensor(eps):
        dtype = torch.promote_types(dtype, eps.dtype)
        out = _to_float32 if dtype == torch.float32 else float
        den = out(a + float(eps))
    else:
        out = rnd
        den = rnd(a + rnd(eps)) if eps_in_trust_ratio else a
    # Both norms > 0 (NaN: neither); then den > 0 (eps > 0).
    ratio = out(w / den) if w > 0 and a > 0 else 1.0
    if max_trust_ratio is not None and ratio > out(max_trust_ratio):
        ratio = out(max_trust_ratio)
    return torch.tensor(ratio, dtype=dtype), ratio


def _sum_sq(x: Tensor) -> Tensor:
    """``sum(x**2)`` as funcpar.shard.reduce.sum_of_squares computes it locally."""
    return torch.linalg.vector_norm(x).square() if x.numel() else x.new_zeros(())


def _lamb(lr, weight_decay, eps, *, betas, bias_correction, weight_decay_mode, max_weight_norm,
          max_trust_ratio, eps_in_trust_ratio, grad_averaging, adam, maximize, weight_decay_mask):
    beta1, beta2 = betas
    # A Python number, not a tensor: torch.add's alpha fuses the way the references' add_ does.
    m_coef = (1.0 - beta1) if grad_averaging else 1.0
    ratio_opts = dict(max_weight_norm=max_weight_norm, max_trust_ratio=max_trust_ratio,
                      eps_in_trust_ratio=eps_in_trust_ratio)

    def init(params: Tree) -> LambState:
        check_floating(params, who="lamb")
        return LambState(
            torch.zeros((), dtype=torch.int64),
            tree_map(torch.zeros_like, params),
            tree_map(torch.zeros_like, params),
            tree_map(lambda p: torch.ones((), dtype=p.dtype, device=p.device), params),
        )

    def step(grads, state: LambState, params, layouts, write_params: bool):
        count = state.count + 1
        t = count.to(torch.float64)
        bc1 = 1 - beta1**t
        bc2 = 1 - beta2**t
        step_size = {
            "moments": lr,
            "none": lr,
            "step_size": lr * bc2.sqrt() / bc1,
            "step_size_m": lr / bc1,
        }[bias_correction]
        s = LambScalars(beta1=beta1, beta2=beta2, m_coef=m_coef, bc1=bc1, bc2=bc2, eps=eps,
                        weight_decay=weight_decay, shrink=1 - lr * weight_decay,
                        moments=bias_correction == "moments",
                        in_update=weight_decay_mode == "in_update", maximize=maximize)
        spec, g, (p, m, v, lay) = checked_leaf_columns(
            grads, params, state.exp_avg, state.exp_avg_sq, layouts)
        dec = mask_flags(weight_decay_mask, params, spec)
        hyper = [x for x in (lr, weight_decay, eps) if torch.is_tensor(x)]
        if lamb_kernels_apply(*g, *p, *m, *v, hyper=hyper):
            out, m, v, ratio = fused(g, p, m, v, dec, lay, s, step_size, write_params)
        elif (all(x is None for x in lay)
              and all(x.dtype == y.dtype == z.dtype == w.dtype for x, y, z, w in zip(g, p, m, v))
              and _lk.lamb_fast_ok([*g, *p, *m, *v], hyper)):
            out, m, v, ratio = eager(g, p, m, v, dec, s, step_size, write_params)
        else:
            out, m, v, ratio = reference(g, p, m, v, dec, lay, s, step_size)
            if write_params:
                out = [p_j + u.to(p_j.dtype) for p_j, u in zip(p, out)]
        new = [tree_unflatten(spec, x) for x in (out, m, v, ratio)]
        return new[0], LambState(count, *new[1:])

    def reference(g, p, m, v, dec, lay, s, step_size):
        # The reference: each leaf's direction, then every sharded leaf's two local sums of
        # squares completed in one batched all-reduce per mesh axis (sum_partials), then each
        # leaf's trust ratio and update. A whole leaf (no layout) takes torch's norm directly,
        # as funcpar.shard.reduce.norm does; a laid-out one its sum of squares, summed, rooted.
        dirs = [lamb_direction(*row, s) for row in zip(g, p, m, v, dec)]
        partials, lays, whys = [], [], []
        for (_, _, a, w), layout in zip(dirs, lay):
            if layout is not None:
                partials += [_sum_sq(w), _sum_sq(a)]
                lays += [layout, layout]
                whys += ["lamb weight norm", "lamb update norm"]
        sums = iter(sum_partials(partials, lays, [None] * len(lays), purpose=whys))
        out, ms, vs, ratios = [], [], [], []
        for (m_j, v_j, a, w), p_j, layout in zip(dirs, p, lay):
            if layout is None:
                w_norm, a_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(a)
            else:
                w_norm, a_norm = next(sums).sqrt(), next(sums).sqrt()
            ratio = _trust_ratio(w_norm, a_norm, eps, **ratio_opts)
            used = torch.ones_like(ratio) if adam else ratio
            out.append((w - p_j) - (step_size * used) * a)
            ms.append(m_j)
            vs.append(v_j)
            ratios.append(ratio)
        return out, ms, vs, ratios

    def eager(g, p, m, v, dec, s, step_size, write_params):
        # Whole leaves need no reduction between the passes: each leaf's step runs to its end
        # before the next one's, in place. The reference's torch operations in its order,
        # written into buffers: the same bits, up to the sign of a zero (p + (0 - c a) is
        # formed as p - c a). Inside inplace_updates the moments (and, writing them, the
        # params) are updated in place, else written fresh by the same operations, so donated
        # and undonated steps are bit-identical. A decay of exactly 0 is skipped (a + 0 p is
        # a, but for the sign of a zero).
        # Buffers: the direction a (its denominator first, c a last) and, where the variant
        # needs a second tensor (bias-corrected moments, a decay), b. A donated apply writes
        # p in place, so a and b are scratch shared by all leaves (on a CPU a fresh leaf-sized
        # tensor costs its page faults, more than a pass over it); otherwise the result is a
        # fresh tensor anyway and a is it, b fresh where needed.
        donated = inplace_allowed()
        decays = not host_equals(weight_decay, 0.0)
        step_f = (float(step_size) if torch.is_tensor(step_size) and step_size.dim() == 0
                  and step_size.dtype == torch.float64 else None)
        shared = donated and write_params
        scratch: dict[tuple, list[Tensor]] = {}
        if shared:
            for x in p:
                key = (x.device, x.dtype)
                scratch[key] = [max(x.numel(), scratch.get(key, [0])[0])]
        views: dict[tuple, tuple[Tensor, Tensor | None]] = {}

        def buffers(p_j, two):
            if not shared:
                return torch.empty_like(p_j), torch.empty_like(p_j) if two else None
            key = (p_j.device, p_j.dtype, p_j.shape, two)
            if key not in views:
                flat = scratch[(p_j.device, p_j.dtype)]
                while len(flat) < (3 if two else 2):  # [numel, a, b], made on first use
                    flat.append(torch.empty(flat[0], dtype=p_j.dtype, device=p_j.device))
                views[key] = tuple(x[: p_j.numel()].view(p_j.shape) for x in flat[1:3])
                if not two:
                    views[key] = (views[key][0], None)
            return views[key]

        out, ms, vs, ratios = [], [], [], []
        for g_j, p_j, m_j, v_j, dec_j in zip(g, p, m, v, dec):
            if p_j.dim() == 0:  # 0-d arithmetic promotes with the 0-d hyperparameters
                (u,), (m_new,), (v_new,), (r,) = reference([g_j], [p_j], [m_j], [v_j],
                                                           [dec_j], [None], s, step_size)
                res = p_j + u.to(p_j.dtype) if write_params else u
                if donated:  # the results into the donated storage
                    m_new, v_new = m_j.copy_(m_new), v_j.copy_(v_new)
                    res = p_j.copy_(res) if write_params else res
                out.append(res)
                ms.append(m_new)
                vs.append(v_new)
                ratios.append(r)
                continue
            decay_j = dec_j and decays
            a_buf, b_buf = buffers(p_j, s.moments or decay_j)
            if s.maximize:
                g_j = -g_j
            m_j = (m_j.mul_(beta1) if donated else torch.mul(m_j, beta1)).add_(g_j,
                                                                              alpha=m_coef)
            v_j = (v_j.mul_(beta2) if donated else torch.mul(v_j, beta2)).addcmul_(
                g_j, g_j, value=1 - beta2)
            if s.moments:  # (m / bc1) / (sqrt(v / bc2) + eps)
                den = torch.div(v_j, s.bc2, out=b_buf).sqrt_().add_(s.eps)
                a = torch.div(m_j, s.bc1, out=a_buf).div_(den)
            else:  # m / (sqrt(v) + eps)
                a = torch.div(m_j, torch.sqrt(v_j, out=a_buf).add_(s.eps), out=a_buf)
            w = p_j
            if decay_j and s.in_update:
                a.add_(torch.mul(p_j, s.weight_decay, out=b_buf))
            elif decay_j:
                w = torch.mul(p_j, s.shrink, out=b_buf)
            norms = torch.linalg.vector_norm(w), torch.linalg.vector_norm(a)
            if step_f is not None and p_j.dtype in (torch.float32, torch.float64):
                # The ratio and s * ratio (float64, as the tensors promote) on the host.
                ratio, r = _trust_ratio_host(*norms, eps, **ratio_opts)
                ca = a.mul_(step_f * (1.0 if adam else r))
            else:
                ratio = _trust_ratio(*norms, eps, **ratio_opts)
                ca = a.mul_(step_size * (torch.ones_like(ratio) if adam else ratio))
            if w is p_j:  # (p - p) - c a = -(c a)
                if not write_params:
                    res = ca.neg_()
                elif donated:
                    res = p_j.sub_(ca)
                else:
                    res = torch.sub(p_j, ca, out=ca)
            else:
                u = w.sub_(p_j).sub_(ca)  # (w - p) - c a
                if not write_params:
                    res = u
                elif donated:
                    res = p_j.add_(u)
                else:
                    res = torch.add(p_j, u, out=u)
            out.append(res)
            ms.append(m_j)
            vs.append(v_j)
            ratios.append(ratio)
        return out, ms, vs, ratios

    def fused(g, p, m, v, dec, lay, s, step_size, write_params):
        # The kernels (funcpar.kernels.lamb): pass 1 writes the moments and gives each leaf's
        # local (sum w^2, sum a^2); sum_partials completes them (one all-reduce per mesh axis
        # carrying the pairs of the leaves it splits); pass 2 applies the trust ratio.
        m, v, sums = lamb_moments_triton(g, p, m, v, dec, s)
        if any(x is not None for x in lay):
            # All sharded leaves' pairs in one all-reduce per mesh axis.
            sums = torch.stack(sum_partials(list(sums.unbind(0)), lay, [None] * len(lay),
                                            purpose="lamb norms"))
        # Each norm rounded to float32 as the reference's float32 norm is; the ratio in
        # float64 then rounded to the reference's dtype (a float32 quotient computed in
        # float64 and rounded once is the float32 quotient).
        norms = sums.sqrt().to(torch.float32).to(torch.float64)
        ratio = _trust_ratio(norms[:, 0], norms[:, 1], eps, **ratio_opts)
        # The reference's ratio dtype: float64 where a 0-d float64 hyperparameter met a 0-d
        # tensor (eps in the trust ratio, or a 0-d leaf's a), else the leaf's.
        dtypes = [torch.float64 if eps_in_trust_ratio or x.dim() == 0 else x.dtype for x in p]
        for dt in set(dtypes):
            if dt != torch.float64:
                pick = torch.tensor([d == dt for d in dtypes], device=ratio.device)
                ratio = torch.where(pick, ratio.to(dt).to(torch.float64), ratio)
        used = torch.ones_like(ratio) if adam else ratio
        out = lamb_update_triton(p, m, v, dec, step_size * used, s, write_params=write_params)
        # One 0-d state per leaf (copies: a state leaf never shares storage with another).
        ratios = [ratio[j].to(dt, copy=True) for j, dt in enumerate(dtypes)]
        return out, m, v, ratios

    def update(grads, state: LambState, params=None, *, layouts=None):
        return step(grads, state, params, layouts, write_params=False)

    def apply(grads, state: LambState, params, *, layouts=None):
        return step(grads, state, params, layouts, write_params=True)

    return GradientTransformation(init, update, apply)


def lamb(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: ScalarOrSchedule = 1e-6,
    weight_decay: ScalarOrSchedule = 0.0,
    bias_correction: bool | str | None = None,
    adam: bool = False,
    *,
    variant: str = "default",
    weight_decay_mode: str | None = None,
    max_weight_norm: float | str | None = "variant",
    max_trust_ratio: float | None = None,
    eps_in_trust_ratio: bool | None = None,
    grad_averaging: bool | None = None,
    maximize: bool = False,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """Lamb: Adam's direction, rescaled per leaf by the trust ratio ``||w|| / ||a||``.

    You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
    arXiv 1904.00962. Defaults: ``lr=1e-3``, ``betas=(0.9, 0.999)``, ``eps=1e-6``,
    ``weight_decay=0.0``, ``variant="default"`` (bias-corrected moments, no clamp), ``adam=False``.
    Tested step by step against torch-optimizer and pytorch-optimizer (tests/test_lamb.py:
    measured 2.3e-16 / 2.0e-16 in float64, 9.8e-8 / 4.9e-7 in float32).

    With ``t`` the step (from 1), ``bc1 = 1 - b1^t``, ``bc2 = 1 - b2^t``:

    * ``m_t = b1 m_{t-1} + c g`` (``c = 1 - b1``; ``c = 1`` with ``grad_averaging=False``),
      ``v_t = b2 v_{t-1} + (1 - b2) g^2``;
    * ``a = m_hat / (sqrt(v_hat) + eps) [+ wd * w]`` where ``bias_correction`` decides
      ``m_hat, v_hat``: ``"moments"`` (``True``) ``m/bc1, v/bc2``; otherwise ``m, v``;
    * ``weight_decay_mode``: ``"in_update"`` adds ``wd * w`` to ``a`` (the paper);
      ``"decoupled"`` first shrinks ``w' = w (1 - lr wd)`` and uses ``w'`` from there on;
    * ``tau = ||w'|| / ||a||`` (``/ (||a|| + eps)`` with ``eps_in_trust_ratio``), with
      ``||w'||`` clamped to ``max_weight_norm`` when given; ``tau = 1`` when either norm is 0;
      then ``tau <= max_trust_ratio`` when given; ``adam=True`` uses ``tau = 1`` (Adam);
    * ``w <- w' - s * tau * a`` with the step size ``s = lr`` (``"moments"``, ``"none"``),
      ``lr sqrt(bc2) / bc1`` (``"step_size"``) or ``lr / bc1`` (``"step_size_m"``). Folding the
      correction into ``s`` is *not* the same as correcting the moments: eps is not rescaled
      and ``tau`` is computed from the uncorrected ``a``, so the correction does not cancel in
      ``tau * a`` as it does (up to eps, without decay) with ``"moments"``.

    Under a layout both norms are completed from local sums of squares by
    :func:`funcpar.shard.reduce.sum_partials`: all leaves' weight and update sums together,
    one all-reduce per mesh axis that splits some leaf (not one per leaf, norm and axis).
    ``lr``, ``weight_decay`` and ``eps`` may be schedules. The decay applies where
    ``weight_decay_mask`` allows.

    Which options reproduce which reference exactly (tested step by step):

    * ``variant="default"``: the paper's Algorithm 2 with bias-corrected moments (apex
      FusedLAMB's formula), no clamp.
    * ``variant="torch_optimizer"``: ``torch_optimizer.Lamb`` (0.3.0) defaults: no bias
      correction, decay in ``a``, ``||w||`` clamped to 10; its ``debias=True`` is
      ``bias_correction="step_size"``, its ``clamp_value=x`` is ``max_weight_norm=x``.
    * ``variant="pytorch_optimizer"``: ``pytorch_optimizer.Lamb`` (4.x) defaults: step size
      ``lr / bc1`` only, decoupled decay applied before the norms, ``||w||`` clamped to 10,
      ``tau = ||w|| / (||a|| + eps)``; its ``weight_decouple=False`` is
      ``weight_decay_mode="in_update"``, its ``grad_averaging=False`` ours. Not covered:
      ``rectify``, ``pre_norm`` (a global gradient-norm scaling; chain
      :func:`funcpar.optim.clip_by_global_norm` instead, which differs by its eps),
      ``fixed_decay``, ``adanorm``.
    * ``variant="colossalai"``: Colossal-AI's ``DistributedLamb`` (its ``bias_correction=True``
      default, which Colossal-AI added to the cybertronai code): the correction folded into the
      step size, ``lr sqrt(bc2) / bc1``, no clamp. Its older ``colossalai.nn.optimizer.Lamb``
      has no correction: ``variant="colossalai", bias_correction=False``.

    How the two installed references differ from each other (each difference is an option
    here, and both are tested step by step, float64 and float32):

    ===================  =================================  ==================================
    detail               torch_optimizer.Lamb (0.3.0)       pytorch_optimizer.Lamb (4.x)
    ===================  =================================  ==================================
    bias correction      none (``debias=True``: step size   step size ``lr / bc1``; moments
                         ``lr sqrt(bc2) / bc1``)            and eps uncorrected
    weight decay         ``a += wd w`` (inside the trust    decoupled, before everything:
                         ratio, the paper's)                ``w' = w (1 - lr wd)``
    trust ratio          ``min(||w||, 10) / ||a||``         ``min(||w'||, 10) / (||a|| + eps)``
    either norm zero     ratio 1                            ratio 1
    grad averaging       always ``(1 - b1) g``              option (``grad_averaging``)
    extras not here      --                                 rectify, pre_norm, adanorm, ...
    ===================  =================================  ==================================

    Neither corrects the moments as the paper's Algorithm 2 (and apex's FusedLAMB) does, which
    is why ``variant="default"`` is a third behaviour, tested against the equations.

    ``bias_correction``, ``weight_decay_mode``, ``max_weight_norm``, ``eps_in_trust_ratio``
    and ``grad_averaging`` default to the variant's value (:data:`LAMB_VARIANTS`); pass one to
    override it (``max_weight_norm=None`` removes the clamp).
    """
    who = "lamb"
    if variant not in LAMB_VARIANTS:
        raise ValueError(f"{who}: variant must be one of {sorted(LAMB_VARIANTS)}, got {variant!r}")
    preset = LAMB_VARIANTS[variant]
    if bias_correction is None:
        bias_correction = preset["bias_correction"]
    elif bias_correction is True:
        bias_correction = "moments"
    elif bias_correction is False:
        bias_correction = "none"
    if bias_correction not in ("moments", "step_size", "step_size_m", "none"):
        raise ValueError(f"{who}: bias_correction must be a bool or one of 'moments', "
                         f"'step_size', 'step_size_m', 'none', got {bias_correction!r}")
    weight_decay_mode = weight_decay_mode or preset["weight_decay_mode"]
    if weight_decay_mode not in ("in_update", "decoupled"):
        raise ValueError(f"{who}: weight_decay_mode must be 'in_update' or 'decoupled', "
                         f"got {weight_decay_mode!r}")
    if isinstance(max_weight_norm, str):
        if max_weight_norm != "variant":
            raise ValueError(f"{who}: max_weight_norm must be a number or None, "
                             f"got {max_weight_norm!r}")
        max_weight_norm = preset["max_weight_norm"]
    if eps_in_trust_ratio is None:
        eps_in_trust_ratio = preset["eps_in_trust_ratio"]
    if grad_averaging is None:
        grad_averaging = preset["grad_averaging"]
    validate.nonnegative(who, "lr", lr)
    validate.positive(who, "eps", eps)
    validate.nonnegative(who, "weight_decay", weight_decay)
    betas = validate.betas_in_range(who, betas)
    if max_weight_norm is not None:
        validate.positive(who, "max_weight_norm", max_weight_norm)
        max_weight_norm = float(max_weight_norm)
    if max_trust_ratio is not None:
        validate.positive(who, "max_trust_ratio", max_trust_ratio)
        max_trust_ratio = float(max_trust_ratio)
    return inject_hyperparams(
        _lamb,
        ("lr", "weight_decay", "eps"),
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        betas=betas,
        bias_correction=bias_correction,
        weight_decay_mode=weight_decay_mode,
        max_weight_norm=max_weight_norm,
        max_trust_ratio=max_trust_ratio,
        eps_in_trust_ratio=bool(eps_in_trust_ratio),
        grad_averaging=bool(grad_averaging),
        adam=bool(adam),
        maximize=bool(maximize),
        weight_decay_mask=weight_decay_mask,
    )
