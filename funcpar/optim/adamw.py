"""AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101), as torch.optim.AdamW, and Adam with
coupled L2 decay (Kingma & Ba 2015, arXiv 1412.6980), as torch.optim.Adam: one step, which
differ only in where the decay enters (:mod:`funcpar.optim.decay`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from funcpar.kernels.adamw import AdamWScalars, adamw_step
from funcpar.optim import validate
from funcpar.optim.base import GradientTransformation, check_floating, checked_leaf_columns
from funcpar.optim.decay import decayed
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, mask_flags
from funcpar.optim.schedules import ScalarOrSchedule
from funcpar.state.tree import Tree, tree_map, tree_unflatten

__all__ = ["AdamWState", "adam", "adamw"]


class AdamWState(NamedTuple):
    count: Tensor  # 0-d int64
    exp_avg: Tree
    exp_avg_sq: Tree
    max_exp_avg_sq: Tree  # None per leaf unless amsgrad


def _adamw(lr, weight_decay, eps, *, betas, amsgrad, maximize, weight_decay_mask, eps_root,
           coupled):
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

    def step(grads, state: AdamWState, params, write_params: bool):
        # Every update: the trees flattened once here, not again by each check.
        spec, g, (p, m, v, vmax) = checked_leaf_columns(
            grads, params, state.exp_avg, state.exp_avg_sq, state.max_exp_avg_sq)
        dec = mask_flags(weight_decay_mask, params, spec)
        count = state.count + 1
        decay = weight_decay
        if coupled:
            # torch.optim.Adam: g <- (-g with maximize) + wd p, before the moments; the step
            # then runs without a decoupled decay. A decay of 0 adds nothing (as torch skips).
            if weight_decay.requires_grad or float(weight_decay) != 0:
                g = decayed([-x for x in g] if maximize else g, p, weight_decay, dec)
                maximize_ = False
            else:
                maximize_ = maximize
            decay = torch.zeros_like(weight_decay)
        else:
            maximize_ = maximize
        # step_size = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t) and lr_wd = lr * weight_decay
        # are derived by the paths that read them (kernels.adamw.with_bias_terms): torch's
        # fused CPU kernel, which donated steps run, derives its own.
        scalars = AdamWScalars(step_size=None, bc2_sqrt=None, eps=eps, lr_wd=None,
                               beta1=beta1, beta2=beta2, lr=lr, weight_decay=decay,
                               count=count, eps_root=eps_root)
        # The multi-tensor kernel on CUDA, torch's multi-tensor ops elsewhere, the per-leaf
        # reference when differentiated or vmapped (funcpar.kernels).
        out, m, v, vmax = adamw_step(g, p, m, v, vmax, dec, scalars, amsgrad=amsgrad,
                                     maximize=maximize_, write_params=write_params)
        new = [tree_unflatten(spec, x) for x in (out, m, v, vmax)]
        return new[0], AdamWState(count, *new[1:])

    def update(grads, state: AdamWState, params=None, *, layouts=None):
        return step(grads, state, params, write_params=False)

    def apply(grads, state: AdamWState, params, *, layouts=None):
        return step(grads, state, params, write_params=True)

    return GradientTransformation(init, update, apply)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: ScalarOrSchedule = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    weight_decay_mask: Mask = None,
    eps_root: float = 0.0,
) -> GradientTransformation:
    """Adam with decoupled weight decay, exactly torch.optim.AdamW.

    ``m_t = b1 m_{t-1} + (1 - b1) g``, ``v_t = b2 v_{t-1} + (1 - b2) g^2``
    (``vmax_t = max(vmax_{t-1}, v_t)`` replaces ``v_t`` below with ``amsgrad``),
    ``w <- w - lr * weight_decay * w - lr / (1 - b1^t) * m_t / (sqrt(v_t / (1 - b2^t)
    + eps_root) + eps)``. The decay applies where ``weight_decay_mask`` allows; ``lr``,
    ``weight_decay`` and ``eps`` may be schedules. ``eps_root`` (a number, default 0: torch's
    step bit for bit) keeps the step twice differentiable where ``v_t = 0``, for
    differentiating through it (a dead ReLU unit in a MAML inner loop; optax, torchopt); a
    step with ``eps_root > 0`` always takes the plain-torch reference (funcpar.kernels.adamw).
    """
    return _build("adamw", lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                  weight_decay_mask=weight_decay_mask, eps_root=eps_root, coupled=False)


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: ScalarOrSchedule = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    weight_decay_mask: Mask = None,
    eps_root: float = 0.0,
) -> GradientTransformation:
    """Adam (Kingma & Ba 2015, arXiv 1412.6980) with coupled L2 decay, exactly
    torch.optim.Adam: ``g <- g + weight_decay * w`` (where ``weight_decay_mask`` allows)
    before the moments, then :func:`adamw`'s step without its decoupled decay. The same as
    ``chain(add_decayed_weights(weight_decay), adam(lr, ...))``; ``eps_root`` as in
    :func:`adamw`."""
    return _build("adam", lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                  weight_decay_mask=weight_decay_mask, eps_root=eps_root, coupled=True)


def _build(who, lr, betas, eps, weight_decay, amsgrad, **static) -> GradientTransformation:
    validate.nonnegative(who, "lr", lr)
    validate.positive(who, "eps", eps)
    validate.nonnegative(who, "weight_decay", weight_decay)
    validate.structural(who, "eps_root", static["eps_root"])
    validate.nonnegative(who, "eps_root", static["eps_root"])
    betas = validate.betas_in_range(who, betas)
    return inject_hyperparams(
        _adamw,
        ("lr", "weight_decay", "eps"),
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        betas=betas,
        amsgrad=amsgrad,
        **static,
    )
