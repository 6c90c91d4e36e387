"""CAME: Confidence-guided Adaptive Memory Efficient optimization (Luo et al. 2023,
arXiv 2307.02047), exactly as ``came_pytorch.CAME`` (came-pytorch 0.1.3)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from funcpar.kernels import factored as kernels
from funcpar.optim import validate
from funcpar.optim.base import GradientTransformation, check_floating, checked_leaf_columns
from funcpar.optim.factored import (
    RESIDUAL,
    SECOND_MOMENT,
    clip_divisor_phases,
    compute_dtype,
    eps_pair,
    factored_moment_phases,
    init_moment,
    is_factored,
    no_grad_unless_needed,
    one_pass,
    second_moment_phases,
)
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, mask_flags
from funcpar.shard.reduce import global_shape, run_phased
from funcpar.state.tree import Tree, tree_map, tree_unflatten

__all__ = ["CAMEState", "came"]


class CAMEState(NamedTuple):
    """A 0-d int64 count and, per leaf, a dict of statistics named as in came-pytorch.

    Leaves with >= 2 dims: ``exp_avg`` (leaf-shaped), ``exp_avg_sq_row`` / ``exp_avg_res_row``
    (``shape[:-1]``), ``exp_avg_sq_col`` / ``exp_avg_res_col`` (``shape[:-2] + shape[-1:]``).
    Other leaves: ``exp_avg`` and ``exp_avg_sq`` (leaf-shaped).
    """

    count: Tensor
    stats: Tree


def _leaf_init(p: Tensor) -> dict[str, Tensor]:
    dtype = compute_dtype(p.dtype)
    factored = is_factored(p.shape)
    state = {"exp_avg": torch.zeros(p.shape, dtype=dtype, device=p.device)}
    for names in (SECOND_MOMENT, RESIDUAL):
        state.update(init_moment(p.shape, dtype=dtype, device=p.device, names=names,
                                 factored=factored))
    return state


def _came(lr, weight_decay, clip_threshold, *, betas, eps, weight_decay_mask):
    beta1, beta2, beta3 = betas
    eps1, eps2 = eps

    def init(params: Tree) -> CAMEState:
        check_floating(params, who="came")
        stats = tree_map(lambda p: None if p is None else _leaf_init(p), params)
        return CAMEState(torch.zeros((), dtype=torch.int64), stats)

    def step(grads, state: CAMEState, params, layouts, out):
        def leaf(g, p, st, use_decay, layout):
            if g is None:
                return (None if out == "update" else p), st
            shape = global_shape(g, layout)
            sq = {k: v for k, v in st.items() if k in SECOND_MOMENT}
            precond, new, local_norm = yield from second_moment_phases(
                g, sq, SECOND_MOMENT, beta2, eps1, layout=layout)
            clip = yield from clip_divisor_phases(local_norm, clip_threshold, shape=shape,
                                                  layout=layout)
            coeff = weight_decay * lr if use_decay else None
            # out="update": (new param - param), exact while the step is under half the
            # parameter, so apply_updates reproduces came-pytorch's rounding of the new
            # parameter; out="param": the new parameter, in the same pass.
            if RESIDUAL.row in st:
                # The confidence: how far this step's update u strays from its running mean M;
                # one pass forms u, M and the residual's row/column sums.
                m, res_rows, res_cols = yield from one_pass(
                    kernels.came_residual_batch, g, precond, clip, st["exp_avg"], beta1, eps2)
                res_stats = {RESIDUAL.row: st[RESIDUAL.row], RESIDUAL.col: st[RESIDUAL.col]}
                res_factors, res_new = yield from factored_moment_phases(
                    res_rows, res_cols, res_stats, RESIDUAL, beta3, shape=shape, layout=layout)
                new.update(res_new)
                result, _ = yield from one_pass(kernels.precond_apply_batch, m, p, res_factors,
                                                final=True, post=lr, decay=coeff, out=out)
            else:
                # came-pytorch has no confidence statistics for unfactored leaves: the
                # direction is M itself.
                result, m = yield from one_pass(
                    kernels.precond_apply_batch, g, p, precond, final=True, clip=clip,
                    momentum=st["exp_avg"], beta1=beta1, post=lr, decay=coeff, out=out)
            new["exp_avg"] = m
            return result, new

        # Each leaf's step is phased (passes, and reductions: second moment, its row-factor
        # sum, the update RMS, the residual's statistics and its row-factor sum); run_phased
        # runs all leaves together so each round of reductions costs one all-reduce per mesh
        # axis and each pass one launch for the whole tree.
        spec, g_leaves, (p_leaves, stats, lays) = checked_leaf_columns(
            grads, params, state.stats, layouts)
        decay = mask_flags(weight_decay_mask, params, spec)
        # The eager passes share one scratch buffer; grad mode is off unless an input
        # requires grad (then the passes ask leaf by leaf).
        with kernels.scratch_scope(), no_grad_unless_needed(
                g_leaves, p_leaves, stats, lr, weight_decay, clip_threshold):
            outs = run_phased([leaf(*row) for row in zip(g_leaves, p_leaves, stats, decay,
                                                          lays)])
        results, stats = (tree_unflatten(spec, [o[i] for o in outs]) for i in range(2))
        return results, CAMEState(state.count + 1, stats)

    def update(grads, state: CAMEState, params=None, *, layouts=None):
        return step(grads, state, params, layouts, "update")

    def apply(grads, state: CAMEState, params, *, layouts=None):
        return step(grads, state, params, layouts, "param")

    return GradientTransformation(init, update, apply)


def came(
    lr: Any = 2e-4,
    betas: Sequence[float] = (0.9, 0.999, 0.9999),
    eps: Sequence[float] = (1e-30, 1e-16),
    clip_threshold: Any = 1.0,
    weight_decay: Any = 0.0,
    *,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """CAME, exactly ``came_pytorch.CAME``.

    Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient Optimization", arXiv
    2307.02047. Defaults: ``lr=2e-4``, ``betas=(0.9, 0.999, 0.9999)``, ``eps=(1e-30, 1e-16)``,
    ``clip_threshold=1.0``, ``weight_decay=0.0`` (came-pytorch's, but for ``lr``, see below).
    Tested step by step against came-pytorch 0.1.3 (tests/test_came.py: measured 3.8e-17 in
    float64, 1.1e-8 in float32).

    For each leaf ``W`` with gradient ``g`` (``beta1, beta2, beta3 = betas``;
    ``eps1, eps2 = eps``)::

        x = g^2 + eps1
        >= 2 dims:  R <- beta2 R + (1-beta2) mean_{-1}(x);  C <- beta2 C + (1-beta2) mean_{-2}(x)
                    u = g * rsqrt(R / mean(R)) (x) rsqrt(C)
        otherwise:  V <- beta2 V + (1-beta2) x;  u = g * rsqrt(V)
        u <- u / max(1, RMS(u) / clip_threshold)
        M <- beta1 M + (1-beta1) u
        >= 2 dims:  r = (u - M)^2 + eps2
                    Rr <- beta3 Rr + (1-beta3) mean_{-1}(r)
                    Cr <- beta3 Cr + (1-beta3) mean_{-2}(r)
                    d = M * rsqrt(Rr / mean(Rr)) (x) rsqrt(Cr)
        otherwise:  d = M                     (came-pytorch keeps no confidence for these)
        W <- W - lr weight_decay W - lr d

    As in came-pytorch: no bias correction and no step-dependent beta2 (unlike Adafactor); the
    weight decay is decoupled, scaled by ``lr`` and uses the pre-update ``W``; it applies to every
    leaf unless ``weight_decay_mask`` says otherwise. came-pytorch requires ``lr > 0`` and has no
    default ``lr``; 2e-4 here (the paper's suggested range is Adam's lr / 10 or smaller), and
    ``lr = 0`` is allowed. ``lr``, ``weight_decay`` and ``clip_threshold`` may be schedules.
    Half-precision leaves are computed in float32 (statistics included).
    """
    who = "came"
    validate.nonnegative(who, "lr", lr)
    betas = validate.betas_in_range(who, betas, n=3)
    eps1, eps2 = eps_pair(who, eps)
    validate.positive(who, "eps[0]", eps1)
    validate.positive(who, "eps[1]", eps2)
    validate.positive(who, "clip_threshold", clip_threshold)
    validate.nonnegative(who, "weight_decay", weight_decay)
    return inject_hyperparams(
        _came,
        ("lr", "weight_decay", "clip_threshold"),
        lr=lr,
        weight_decay=weight_decay,
        clip_threshold=clip_threshold,
        betas=tuple(float(b) for b in betas),
        eps=(float(eps1), float(eps2)),
        weight_decay_mask=weight_decay_mask,
    )
