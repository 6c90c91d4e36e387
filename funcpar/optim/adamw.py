"""AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101), as torch.optim.AdamW."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from funcpar.optim import validate
from funcpar.optim.base import GradientTransformation, check_floating, check_grads, map_leaves
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, resolve_mask
from funcpar.optim.schedules import ScalarOrSchedule
from funcpar.state.tree import Tree, tree_map

__all__ = ["AdamWState", "adamw"]


class AdamWState(NamedTuple):
    count: Tensor  # 0-d int64
    exp_avg: Tree
    exp_avg_sq: Tree
    max_exp_avg_sq: Tree  # None per leaf unless amsgrad


def _adamw(lr, weight_decay, eps, *, betas, amsgrad, maximize, weight_decay_mask):
    beta1, beta2 = betas

    def init(params: Tree) -> AdamWState:
        check_floating(params, who="adamw")
        zeros = tree_map(torch.zeros_like, params)
        return AdamWState(
            torch.zeros((), dtype=torch.int64),
            zeros,
            tree_map(torch.zeros_like, params),
            tree_map(lambda p: torch.zeros_like(p) if amsgrad else None, params),
        )

    def update(grads, state: AdamWState, params=None, *, layouts=None):
        check_grads(params, grads)
        decay = resolve_mask(weight_decay_mask, params)
        count = state.count + 1
        t = count.to(torch.float64)
        step_size = lr / (1 - beta1**t)
        bc2_sqrt = (1 - beta2**t).sqrt()

        def leaf(g, p, m, v, vmax, use_decay):
            if maximize:
                g = -g
            m = torch.lerp(m, g, 1 - beta1)
            v = v * beta2 + (1 - beta2) * g * g
            if amsgrad:
                vmax = torch.maximum(vmax, v)
            # Hyperparameters in the leaf's dtype: a 0-d float64 scalar would otherwise promote
            # a 0-d float32 leaf to float64.
            dt = g.dtype
            denom = ((vmax if amsgrad else v).sqrt() / bc2_sqrt.to(dt)) + eps.to(dt)
            u = -step_size.to(dt) * (m / denom)
            if use_decay:
                u = u - (lr * weight_decay).to(dt) * p
            return u, m, v, vmax

        u, m, v, vmax = map_leaves(
            leaf, grads, params, state.exp_avg, state.exp_avg_sq, state.max_exp_avg_sq, decay,
            n_out=4,
        )
        return u, AdamWState(count, m, v, vmax)

    return GradientTransformation(init, update)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: ScalarOrSchedule = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """Adam with decoupled weight decay, exactly torch.optim.AdamW.

    ``m_t = b1 m_{t-1} + (1 - b1) g``, ``v_t = b2 v_{t-1} + (1 - b2) g^2``
    (``vmax_t = max(vmax_{t-1}, v_t)`` replaces ``v_t`` below with ``amsgrad``),
    ``w <- w - lr * weight_decay * w - lr / (1 - b1^t) * m_t / (sqrt(v_t / (1 - b2^t)) + eps)``.
    The decay applies where ``weight_decay_mask`` allows; ``lr``, ``weight_decay`` and ``eps``
    may be schedules.
    """
    who = "adamw"
    validate.nonnegative(who, "lr", lr)
    validate.positive(who, "eps", eps)
    validate.nonnegative(who, "weight_decay", weight_decay)
    betas = validate.betas_in_range(who, betas)
    return inject_hyperparams(
        _adamw,
        ("lr", "weight_decay", "eps"),
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        betas=betas,
        amsgrad=amsgrad,
        maximize=maximize,
        weight_decay_mask=weight_decay_mask,
    )
